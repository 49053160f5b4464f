"""Score a model (with or without a policy applied) against its fp32 reference.

The reference is computed once per data set and reused: every trial of a search compares
against the same fp32 outputs. ``score`` is "error" in the budget's units: the relative L2
error by default, or the metric drop ``metric(fp32) - metric(now)`` with a user metric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.loading import ModelSpec
from autoprec.metrics import ErrorAccumulator, detach_floats, mean_metric


@dataclass
class Reference:
    """fp32 outputs (floating tensors, CPU) and metric of one data set."""

    outputs: list[list[torch.Tensor]]
    metric: float | None
    batches: int


@dataclass
class Score:
    """How far a lowered model is from the reference on one data set."""

    error: float  # relative L2 of the outputs (inf if any non-finite)
    metric: float | None  # user metric, when model.py has one
    metric_drop: float | None  # reference metric - metric
    nonfinite: int

    @property
    def value(self) -> float:
        """The number a budget binds: metric drop when there is a metric, else error."""
        if self.metric_drop is not None:
            return self.metric_drop if self.nonfinite == 0 else math.inf
        return self.error


def _outputs(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any], what: str,
             lowered: bool = False) -> list[Any]:
    """Forward every batch. A failure of the fp32 model is the user's (ModelFileError, exit
    2); once the fp32 reference ran, a failure under a policy is not: it propagates as is
    (a search trial records it as failed, with the reason)."""
    outs = []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            outs.append(spec.forward(model, batch) if lowered else spec.run(model, batch, i, what))
    return outs


def reference(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any],
              what: str = "") -> Reference:
    """Run the fp32 model once over ``batches`` and keep its outputs and metric."""
    outs = _outputs(spec, model, batches, what)
    metric = mean_metric(spec.metric, outs, batches) if spec.metric is not None else None
    return Reference([detach_floats(o) for o in outs], metric, len(batches))


def score(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any], ref: Reference,
          what: str = "") -> Score:
    """Run ``model`` (as it is now, e.g. with a policy applied) and compare to ``ref``."""
    outs = _outputs(spec, model, batches, what, lowered=True)
    acc = ErrorAccumulator()
    for out, r in zip(outs, ref.outputs):
        acc.add(out, r)
    metric = drop = None
    if spec.metric is not None and ref.metric is not None:
        metric = mean_metric(spec.metric, outs, batches)
        drop = ref.metric - metric if math.isfinite(metric) else math.inf
    return Score(acc.error, metric, drop, acc.nonfinite)
