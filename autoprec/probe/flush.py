"""How many values of a gradient flush to zero / overflow when cast to a gradient format.

``GradFlush(g).counts(pairs)`` answers every (precision, loss scale) of one gradient from
one pass over ``|g|``: a cast of an fp32 value to fp16 / bf16 rounds to nearest even, so
whether it becomes 0 or inf depends only on ``|x|`` against two fixed thresholds
(``cast_thresholds``: half the smallest subnormal, and the largest finite value plus half
its ulp, where the tie rounds to the even neighbour — 0, and inf). With a loss scale ``s``
that is a power of two and at least 1, ``g * s`` is exact in fp32 (or overflows, which the
threshold counts too), so ``|g| * s <= z`` is ``|g| <= z / s``: every threshold of every
(precision, scale) goes into one sorted boundary list and ``bucketize`` + ``bincount``
count all of them at once. The GEMM formats' gradients (fp8's e5m2 with current scaling,
mxfp8's blocks) and other scales are cast for real, one pass per (precision, scale).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import torch

from autoprec.formats.gemm import format_of

#: The 16-bit gradient dtypes counted by thresholds (``cast_thresholds``).
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Smallest positive fp32 value (subnormal): "|x| < _TINY" means "x == 0".
_TINY = float(np.nextafter(np.float32(0), np.float32(1)))


@functools.cache
def cast_thresholds(precision: str) -> tuple[float, float]:
    """(z, o) for fp16 / bf16: an fp32 value x casts to 0 iff |x| <= z, to ±inf iff |x| >= o
    (round to nearest even; IEEE subnormals kept — tests check both sides of each)."""
    fi = torch.finfo(_DTYPES[precision])
    subnormal = float(fi.smallest_normal) * float(fi.eps)  # eps = 2**-(mantissa bits)
    top_ulp = 2.0 ** math.floor(math.log2(float(fi.max))) * float(fi.eps)
    return subnormal / 2.0, float(fi.max) + top_ulp / 2.0


def _floor32(t: float) -> float:
    """The largest fp32 value <= t (t >= 0)."""
    f = np.float32(t)
    if float(f) > t:
        f = np.nextafter(f, np.float32(-np.inf))
    return float(f)


def _ceil32(t: float) -> float:
    """The smallest fp32 value >= t (inf past fp32's max)."""
    f = np.float32(t)
    if float(f) < t:
        f = np.nextafter(f, np.float32(np.inf))
    return float(f)


def _by_threshold(precision: str, scale: float) -> bool:
    return (precision in _DTYPES and scale >= 1.0 and math.isfinite(scale)
            and math.frexp(scale)[0] == 0.5)  # a power of two: g * scale is exact


class GradFlush:
    """``grad_flush`` of one gradient for many (precision, scale), from one pass over |g|
    for fp16 / bf16 at power-of-two scales (module doc); the rest cast for real."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g.detach().float()
        a = self.g.abs().reshape(-1)
        if a.numel() and not math.isfinite(float(a.max())):  # NaN / inf: counted as zeros
            a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
        self._a = a
        self._zeros = int((a < _TINY).sum())
        self.n = a.numel() - self._zeros  # finite nonzero values

    def counts(self, pairs: Iterable[tuple[str, float]]
               ) -> dict[tuple[str, float], tuple[int, int, int]]:
        """(nonzero, flushed to zero, overflowed) for each (precision, scale)."""
        out: dict[tuple[str, float], tuple[int, int, int]] = {}
        fast: dict[tuple[str, float], tuple[float, float]] = {}
        for precision, scale in pairs:
            if precision in ("fp32", "tf32") or self.n == 0:
                out[(precision, scale)] = (self.n, 0, 0)
            elif _by_threshold(precision, scale):
                z, o = cast_thresholds(precision)
                # |g| <= z/s: |g| < the fp32 value after floor32(z/s); |g| >= o/s
                fast[(precision, scale)] = (
                    float(np.nextafter(np.float32(_floor32(z / scale)), np.float32(np.inf))),
                    _ceil32(o / scale))
            else:
                out[(precision, scale)] = self._cast(precision, scale)
        if fast:
            bounds = sorted({b for pair in fast.values() for b in pair if math.isfinite(b)})
            edges = torch.tensor(bounds, dtype=torch.float32, device=self._a.device)
            below = dict(zip(bounds, torch.bincount(
                torch.bucketize(self._a, edges, right=True),
                minlength=len(bounds) + 1).cumsum(0).tolist()))  # b -> #values < b
            total = self._a.numel()
            for key, (z_edge, o_edge) in fast.items():
                over = total - below[o_edge] if math.isfinite(o_edge) else 0
                out[key] = (self.n, below[z_edge] - self._zeros, over)
        return out

    def count(self, precision: str, scale: float = 1.0) -> tuple[int, int, int]:
        """(nonzero, flushed to zero, overflowed) of the gradient cast to ``precision``."""
        return self.counts([(precision, scale)])[(precision, scale)]

    def _cast(self, precision: str, scale: float) -> tuple[int, int, int]:
        """The real cast (``g * scale`` to fp16/bf16; the GEMM formats' gradient recipe)."""
        g = self.g
        nz = (g != 0) & torch.isfinite(g)
        gemm = format_of(precision)
        if gemm is not None and gemm.forward_only:  # no gradients flow in it
            return self.n, 0, 0
        gs = g * scale
        if gemm is not None:  # as its backward reads dY (fp8: e5m2, mxfp8: e4m3 blocks of 32)
            low = gemm.fake_quant_grad(torch.where(nz, gs, torch.zeros_like(gs)))
        else:
            low = gs.to(_DTYPES[precision]).float()
        return self.n, int((nz & (low == 0)).sum()), int((nz & torch.isinf(low)).sum())


def grad_flush(g: torch.Tensor, precision: str, scale: float = 1.0) -> tuple[int, int, int]:
    """(nonzero, flushed to zero, overflowed) when gradient ``g`` is cast to ``precision``.

    The cast as it happens (``g * scale`` to fp16/bf16, e5m2 with current scaling for
    fp8), so subnormals count as kept; tf32/fp32 gradients stay fp32.
    """
    return GradFlush(g).count(precision, scale)
