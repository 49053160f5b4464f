"""GEMM formats — fp8, mxfp8, nvfp4 — behind one call: run a Linear-like leaf in one.

Which layers may run a format, and why not, is the format's own fact
(``autoprec.formats.gemm``); this module only dispatches a forward to the backend that
runs it: fp8 (per-tensor current scaling) in ``fp8.py``, mxfp8 / nvfp4 (block scales
along K) in ``blockscale.py``.
"""

from __future__ import annotations

import torch

from autoprec.lower import blockscale, fp8


def linear(module: torch.nn.Module, x: torch.Tensor, precision: str,
           backend: str = "emulated") -> torch.Tensor:
    """Run the Linear-like ``module`` on ``x`` in GEMM format ``precision``."""
    if precision == "fp8":
        return fp8.fp8_linear(module, x, backend)
    return blockscale.blockscaled_linear(module, x, precision, backend)


__all__ = ["linear"]
