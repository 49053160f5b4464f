"""Sensitivity probes: per layer × precision, how much lowering that layer alone costs.

``probe(model, batches, ...) -> SensitivityTable`` measures, for every GEMM layer:
local error (shadow computation on the fp32 inputs, all layers in one pass), ranges
(overflow / underflow / non-finite against each format), a cheap first-order estimate of
the end-to-end error (one backward for all layers), with a loss the gradient probes, and
end-to-end errors where asked or where the estimate is ambiguous.
"""

from __future__ import annotations

from autoprec.probe.api import probe, resolve_precisions
from autoprec.probe.table import CORE_COLUMNS, ProbeRow, SensitivityTable

__all__ = ["CORE_COLUMNS", "ProbeRow", "SensitivityTable", "probe", "resolve_precisions"]
