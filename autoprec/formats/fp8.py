"""fp8 with per-tensor current scaling: one fp32 scale per tensor, from its amax.

Scaling follows the "current scaling" recipe: scale = fmax / amax(tensor), so the largest
magnitude maps to the format's max (448 for e4m3, 57344 for e5m2; OCP FP8 spec,
``elements.ELEM_MAX``). The fp8 GEMM reads e4m3 operands forward and e5m2 gradients
backward; the Linear backend that runs it lives in ``autoprec.lower.fp8``.
"""

from __future__ import annotations

import torch

from autoprec.formats.elements import E4M3, E5M2, ELEM_MAX

#: elements per piece when a large tensor is scaled, cast or read back (64 MB of fp32): an
#: 8 B Llama's LM head (0.5 G elements) would otherwise take 2 GB of fp32 per copy
CHUNK = 1 << 24


def row_chunks(t: torch.Tensor) -> list[slice]:
    """Slices of ``t``'s first dimension, each at most ``CHUNK`` elements (one slice for a
    small tensor)."""
    rows = t.shape[0] if t.dim() else 1
    per_row = max(1, t.numel() // max(rows, 1))
    step = max(1, CHUNK // per_row)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)] or [slice(0, 0)]


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling: returns (x_fp8, scale) with x ≈ x_fp8 / scale."""
    # amax in one pass without an |x| buffer (exact in the input's own dtype); the scaled
    # copy clamped in place (exact same values as abs().amax() and an out-of-place clamp:
    # the CPU emulation's hot path), in pieces of CHUNK elements for a large tensor
    lo, hi = torch.aminmax(x) if x.numel() else (x.new_zeros(()), x.new_zeros(()))
    amax = torch.maximum(-lo.float(), hi.float()).clamp(min=1e-12)
    fmax = ELEM_MAX[dtype]
    # one correctly rounded division, as the recipe reads: `fmax / amax` with a Python
    # float on the left is torch's reciprocal-then-multiply (two roundings), a scale 1 ulp
    # off that decides ties of the few-bit values a 16-bit gradient brings to e5m2
    scale = torch.div(fmax, amax)
    if x.dim() < 2 or x.numel() <= CHUNK:
        return (x.float() * scale).clamp_(-fmax, fmax).to(dtype), scale
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    for rows in row_chunks(x):
        q[rows] = (x[rows].float() * scale).clamp_(-fmax, fmax).to(dtype)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values ``q / scale`` of a :func:`quantize_fp8` result."""
    return q.float().div_(scale)


def fake_quant_fp8(x: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """x rounded through fp8 with per-tensor current scaling, back in fp32."""
    q, s = quantize_fp8(x, dtype)
    return dequantize_fp8(q, s)


__all__ = ["CHUNK", "E4M3", "E5M2", "dequantize_fp8", "fake_quant_fp8", "quantize_fp8",
           "row_chunks"]
