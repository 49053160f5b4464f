"""Reference quantisers written from the format definitions, independent of autoprec.

Nothing here imports autoprec: a test that checks autoprec's numerics against these checks
it against the definitions, not against itself. Every rounding is IEEE 754
roundTiesToEven; the formats saturate (a finite value past the largest magnitude becomes
it), as the recipes autoprec follows do.

- tf32: fp32's sign and 8 exponent bits, the top 10 of its 23 mantissa bits; the 13
  dropped bits rounded on the integer bit pattern (NVIDIA A100 whitepaper, "TF32").
- Minifloats (OCP 8-bit FP spec v1.0; OCP MX spec v1.0 table 5): every magnitude a code
  ``0 EE..E MM..M`` stands for, enumerated from exponent bits, mantissa bits and bias
  (E4M3: bias 7, no inf, S.1111.111 is NaN, max 448; E5M2: bias 15, exponent 31 is
  inf/NaN, max 57344; E2M1: bias 1, no inf/NaN, max 6). Positive codes order the
  magnitudes, so "ties to even" picks the neighbour with the even code.
- Per-tensor fp8 current scaling (docs/overview.md): s = fmax / amax(x), q = RNE(x * s),
  value q / s, in fp32.
- MXFP8 (OCP MX spec v1.0 section 6.3; the E8M0 exponent chosen as cuBLAS / Transformer
  Engine do, X = 2**ceil(log2(amax_b / 448)), "rceil"): blocks of 32 along the last dim.
- NVFP4 (Transformer Engine's two-level recipe): g = amax / (448 * 6) per tensor,
  s_b = RNE_e4m3(clamp((amax_b / 6) / g, 2**-6, 448)) per 16, q = RNE_e2m1(x / (g s_b)),
  value q * (g * s_b).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class Minifloat:
    """A sign-magnitude binary format: ``ebits`` exponent bits with ``bias``, ``mbits``
    mantissa bits; exponent field 0 is subnormal. ``top`` is the largest code that is a
    finite magnitude (E4M3's 0x7E: 0x7F is NaN; E5M2's 0x7B: 0x7C.. are inf/NaN)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    top: int

    def magnitude(self, code: int) -> float:
        e, m = code >> self.mbits, code & ((1 << self.mbits) - 1)
        if e == 0:  # subnormal: 0.m * 2**(1 - bias)
            return math.ldexp(m / (1 << self.mbits), 1 - self.bias)
        return math.ldexp(1 + m / (1 << self.mbits), e - self.bias)

    @cached_property
    def grid(self) -> tuple[float, ...]:
        """The magnitudes of codes 0..top, increasing."""
        return tuple(self.magnitude(c) for c in range(self.top + 1))

    @property
    def max(self) -> float:
        return self.grid[-1]


E4M3 = Minifloat("e4m3", ebits=4, mbits=3, bias=7, top=0x7E)
E5M2 = Minifloat("e5m2", ebits=5, mbits=2, bias=15, top=0x7B)
E2M1 = Minifloat("e2m1", ebits=2, mbits=1, bias=1, top=0x7)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}


def round_to(fmt: Minifloat, x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded onto ``fmt`` (ties to the even code, saturating at ±max), as fp32.
    NaN stays NaN; ±inf saturates."""
    x = x.detach().float()
    a = x.abs().double()  # exact copy; every grid value and midpoint is exact in fp64
    grid = torch.tensor(fmt.grid, dtype=torch.float64)
    lo = (torch.searchsorted(grid, a, right=True) - 1).clamp(0, len(grid) - 1)
    hi = (lo + 1).clamp(max=len(grid) - 1)
    mid = (grid[lo] + grid[hi]) / 2
    up = (a > mid) | ((a == mid) & (lo % 2 == 1))
    mag = torch.where(up, grid[hi], grid[lo])
    mag = torch.where(a >= fmt.max, torch.full_like(mag, fmt.max), mag)
    out = torch.copysign(mag.float(), x)
    return torch.where(torch.isnan(x), x, out)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to tf32: keep 19 bits, round the 13 dropped ones to nearest, ties
    to even. The magnitude bits carry into the exponent (1.11..1 * 2**e becomes 2**(e+1);
    past the largest finite, inf); inf and NaN stay as they are."""
    a = x.detach().float().cpu().contiguous().numpy()
    u = a.view(np.uint32)
    dropped = u & np.uint32(0x1FFF)
    kept = u & ~np.uint32(0x1FFF)
    odd = (kept >> np.uint32(13)) & np.uint32(1)
    up = (dropped > 0x1000) | ((dropped == 0x1000) & (odd == 1))
    out = kept + up.astype(np.uint32) * np.uint32(0x2000)
    out = np.where(np.isnan(a), u, out)  # a NaN's payload must not round into inf
    return torch.from_numpy(out.view(np.float32).copy()).to(x.device)


def ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded``'s values with ``x``'s gradient (a straight-through estimator)."""
    return x + (rounded - x).detach() if x.requires_grad else rounded


def fp8_current_scaling(x: torch.Tensor, fmt: Minifloat = E4M3) -> torch.Tensor:
    """``x`` through fp8 with one scale per tensor, s = fmax / amax, back in fp32."""
    x = x.detach().float()
    amax = x.abs().max()
    if amax == 0:
        return torch.zeros_like(x)
    s = torch.tensor(fmt.max, dtype=torch.float32) / amax
    return round_to(fmt, x * s) / s


def _blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    k = x.shape[-1]
    if k % n:
        raise ValueError(f"the last dim {k} is not a multiple of the block size {n}")
    return x.detach().float().reshape(*x.shape[:-1], k // n, n)


def mxfp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` through MXFP8 (E4M3 elements, one E8M0 power of two per 32 along the last
    dim, X = 2**ceil(log2(amax_b / 448)) clamped to 2**-127..2**127), back in fp32."""
    xb = _blocks(x, 32)  # (..., nb, 32)
    amax = xb.abs().amax(-1).numpy()  # (..., nb)
    ratio = (amax / np.float32(E4M3.max)).astype(np.float32)
    m, ex = np.frexp(ratio)  # ratio = m * 2**ex, m in [0.5, 1): ceil(log2) = ex - (m == .5)
    e = np.where(m == 0.5, ex - 1, ex)
    e = np.where(amax > 0, e, -127).clip(-127, 127)
    scale = torch.from_numpy(np.ldexp(np.float32(1), e).astype(np.float32)).unsqueeze(-1)
    return (round_to(E4M3, xb / scale) * scale).reshape(x.shape)


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    """``x`` through NVFP4 (E2M1 elements, an E4M3 scale per 16 along the last dim under a
    fp32 per-tensor scale g = amax / 2688), back in fp32."""
    xb = _blocks(x, 16)  # (..., nb, 16)
    g = xb.abs().max() / np.float32(E4M3.max * E2M1.max)
    amax_b = xb.abs().amax(-1, keepdim=True)  # (..., nb, 1)
    s_b = round_to(E4M3, ((amax_b / E2M1.max) / g).clamp(2.0**-6, E4M3.max))
    q = round_to(E2M1, xb * ((1.0 / g) / s_b))
    return (q * (g * s_b)).reshape(x.shape)


def nvfp4_2d(w: torch.Tensor) -> torch.Tensor:
    """A 2-D weight (N, K) through NVFP4 in 16x16 tiles (NVIDIA's training recipe: one E4M3
    scale per tile under the fp32 per-tensor scale g = amax / 2688), back in fp32."""
    n, k = w.shape
    t = w.detach().float().reshape(n // 16, 16, k // 16, 16).permute(0, 2, 1, 3)  # tiles
    tb = t.reshape(n // 16, k // 16, 256)  # (N/16, K/16, 256): a tile as one block
    g = tb.abs().max() / np.float32(E4M3.max * E2M1.max)
    amax_t = tb.abs().amax(-1, keepdim=True)
    s_t = round_to(E4M3, ((amax_t / E2M1.max) / g).clamp(2.0**-6, E4M3.max))
    q = round_to(E2M1, tb * ((1.0 / g) / s_t)) * (g * s_t)
    return q.reshape(n // 16, k // 16, 16, 16).permute(0, 2, 1, 3).reshape(n, k)


__all__ = ["E2M1", "E4M3", "E5M2", "FORMATS", "Minifloat", "fp8_current_scaling", "mxfp8",
           "nvfp4", "nvfp4_2d", "round_tf32", "round_to", "ste"]
