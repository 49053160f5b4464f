"""GEMM formats — fp8, mxfp8, nvfp4 — behind one interface: who may run one, and how.

A GEMM format is not an autocast region but a backend for a Linear-like leaf (DESIGN.md):
the leaf quantises its input and weight and runs the low-precision GEMM, taking and giving
the surrounding region's dtype. fp8 (per-tensor current scaling) lives in ``fp8.py``;
mxfp8 / nvfp4 (block scales along K) in ``blockscale.py``. This module is the one place
that dispatches between them, so policy resolution, apply, probes and the tracer ask the
same question the same way.
"""

from __future__ import annotations

import torch

from autoprec.apply import blockscale, fp8
from autoprec.fused import not_called_reason
from autoprec.precisions import BLOCK_SCALED, GEMM_FORMATS


def ineligible_reason(module: torch.nn.Module, precision: str,
                      training: bool = False) -> str | None:
    """Why ``module`` cannot run GEMM format ``precision`` (None: it can)."""
    why = not_called_reason(module)
    if why is not None and precision in GEMM_FORMATS:
        return f"{precision}: {why}"
    if precision == "fp8":
        return fp8.fp8_ineligible_reason(module)
    if precision in BLOCK_SCALED:
        return blockscale.mx_ineligible_reason(module, precision, training=training)
    raise ValueError(f"{precision!r} is not a GEMM format ({', '.join(GEMM_FORMATS)})")


def eligible(module: torch.nn.Module, precision: str) -> bool:
    """A leaf that can run ``precision`` (fp8 / mxfp8 / nvfp4)."""
    return next(iter(module.children()), None) is None and \
        ineligible_reason(module, precision) is None


def linear(module: torch.nn.Module, x: torch.Tensor, precision: str,
           backend: str = "emulated") -> torch.Tensor:
    """Run the Linear-like ``module`` on ``x`` in GEMM format ``precision``."""
    if precision == "fp8":
        return fp8.fp8_linear(module, x, backend)
    return blockscale.blockscaled_linear(module, x, precision, backend)


__all__ = ["eligible", "ineligible_reason", "linear"]
