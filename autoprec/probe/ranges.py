"""Range statistics: does a tensor fit a precision's number format?

For each layer the probe keeps one ``TensorRange`` per tensor class (inputs, weights,
outputs), accumulated over every call on the calibration data, and counts per precision:

- overflow: finite values beyond the format's max (fp16: 65504) — they become inf;
- underflow: nonzero values below the format's smallest normal (fp16: 2**-14 ≈ 6.1e-5) —
  they lose precision as subnormals and flush to zero below 2**-24;
- non-finite values already present in fp32.

fp8 uses per-tensor current scaling (docs/overview.md): a tensor is multiplied by
``448 / amax`` before the cast, so it never overflows; a value underflows when it is
below ``amax * 2**-6 / 448`` (OCP FP8 spec: e4m3 smallest normal 2**-6, max 448).
tf32 and bf16 have fp32's exponent range (FORMATS in precisions.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from autoprec.formats.fp8 import CHUNK
from autoprec.formats.gemm import format_of
from autoprec.formats.precisions import FORMATS
from autoprec.probe.flush import GradFlush, grad_flush

#: Smallest positive fp32 value (subnormal): "a < _TINY" means "a == 0".
_TINY = 1.4e-45


@dataclass
class TensorRange:
    """Range of one tensor class of one layer, accumulated over calls."""

    max_abs: float = 0.0  # over finite values
    numel: int = 0
    nonzero: int = 0  # finite nonzero values
    nonfinite: int = 0  # NaN/inf already in fp32
    overflow: dict[str, int] = field(default_factory=dict)  # precision -> count
    underflow: dict[str, int] = field(default_factory=dict)  # precision -> count

    def add(self, tensors: Iterable[torch.Tensor], precisions: Sequence[str]) -> None:
        """Count ``tensors`` (any floating dtype, any shape) against each precision.

        Two reads per tensor whatever the number of precisions: its largest finite
        magnitude (per-tensor-scaled formats' thresholds follow it), then every threshold
        in one sorted boundary list, ``bucketize`` + ``bincount`` counting all intervals at
        once. A large tensor (an 8 B Llama's LM head: 525 M values) is read in pieces of
        ``CHUNK`` values: its fp32 magnitudes and their bucket indices whole would be
        ~6 GB.
        """
        for t in tensors:
            if not t.is_floating_point() or t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            pieces = [flat[i:i + CHUNK] for i in range(0, flat.numel(), CHUNK)]
            amax, bad = 0.0, 0
            for piece in pieces:
                a = piece.abs()
                m = float(a.max())
                if not math.isfinite(m):  # NaN or inf present: the slow path
                    finite = torch.isfinite(a)
                    bad += int((~finite).sum())
                    m = float(torch.where(finite, a, torch.zeros((), dtype=a.dtype,
                                                                  device=a.device)).max())
                amax = max(amax, m)
            # Thresholds, counted as "how many values are < threshold":
            # zero test (< smallest fp32 subnormal), underflow (< smallest normal or the
            # scaled threshold), overflow (> max, i.e. not < nextafter(max)).
            wanted: dict[str, tuple[float | None, float | None]] = {}
            for p in precisions:
                fmt, gemm = FORMATS[p], format_of(p)
                # block-scaled: a scale per 16/32 elements, so nothing overflows and a
                # per-tensor underflow count says little (the floor moves per block)
                if gemm is not None and gemm.block_scaled:
                    wanted[p] = (None, None)
                    continue
                if gemm is not None and gemm.per_tensor_scaled:  # amax scales the tensor
                    under = amax * fmt.smallest_normal / fmt.max if amax > 0 else None
                    over = None
                else:
                    under = fmt.smallest_normal
                    over = math.nextafter(fmt.max, math.inf) if fmt.max < 3.0e38 else None
                wanted[p] = (under, over)
            bounds = sorted({_TINY, *(x for pair in wanted.values() for x in pair if x)})
            edges = torch.tensor(bounds, dtype=torch.float32, device=flat.device)
            hist = torch.zeros(len(bounds) + 1, dtype=torch.int64, device=flat.device)
            for piece in pieces:
                a = piece.abs().float()
                if bad:  # the non-finite values count as zeros here (taken out below)
                    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype,
                                                                      device=a.device))
                hist += torch.bincount(torch.bucketize(a, edges, right=True),
                                       minlength=len(bounds) + 1)
            below = dict(zip(bounds, hist.cumsum(0).tolist()))  # threshold -> count below
            zeros = below[_TINY] - bad  # the non-finite values were zeroed above
            self.numel += flat.numel()
            self.nonzero += flat.numel() - zeros - bad
            self.nonfinite += bad
            self.max_abs = max(self.max_abs, amax)
            for p, (under, over) in wanted.items():
                n_under = below[under] - below[_TINY] if under else 0
                n_over = flat.numel() - below[over] if over else 0
                self.overflow[p] = self.overflow.get(p, 0) + n_over
                self.underflow[p] = self.underflow.get(p, 0) + n_under

    def underflow_frac(self, precision: str) -> float:
        """Share of nonzero values below the smallest normal of ``precision``."""
        return self.underflow.get(precision, 0) / self.nonzero if self.nonzero else 0.0


def fmt_num(x: float) -> str:
    """Compact number for reasons: 3.1e+05, 0.0042, inf."""
    if not math.isfinite(x):
        return "inf" if x > 0 else str(x)
    return f"{x:.2g}"


__all__ = ["GradFlush", "TensorRange", "fmt_num", "grad_flush"]
