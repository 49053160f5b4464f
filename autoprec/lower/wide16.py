"""16-bit GEMMs a CPU has no kernel for, computed the way a GPU computes them.

A CPU without AVX512-FP16 / AMX-FP16 runs an fp16 matmul in a reference loop, orders of
magnitude slower than fp32 (the measurements: docs/overview.md, "Measured facts behind the
code"). A tune for a GPU target runs its 16-bit candidates on this CPU only to *score*
them (error against the reference), so scoring must not pay for that loop.

``Wide16`` computes such a GEMM as a GPU's tensor cores do: the 16-bit operands upcast to
fp32 (exact: every fp16 / bf16 value is an fp32 value), one fp32 GEMM (fp32 accumulation,
as cuBLAS and oneDNN accumulate 16-bit GEMMs), the result rounded to the 16-bit dtype. The
numbers differ from the CPU's own 16-bit kernel only in summation order (a last-ulp
rounding of some outputs; tests/lower/test_wide16.py), and the op is still seen as 16-bit
by any mode entered after this one (the audit records the GEMM's precision first).

It is for scoring only: speed is never measured under it (timing runs the CPU's own
kernels, which is what a deployment on this CPU runs). ``scoring_gemms()`` turns it on for
the dtypes this CPU runs slower than fp32 (``slow_dtypes``: a 256^3 matmul timed once per
process; ``AUTOPREC_WIDE16=1`` / ``0`` forces it on / off).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autoprec.formats.fp8 import CHUNK

_aten = torch.ops.aten
#: The GEMM ops computed wide (SDPA is left to the CPU: its fp16 kernel is 2.4x fp32, not 167x).
GEMM_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                      _aten.baddbmm.default, _aten.convolution.default})
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: A 16-bit dtype this many times slower than fp32 on a 256^3 matmul is computed wide.
SLOW_FACTOR = 1.5


class Wide16(TorchDispatchMode):
    """GEMMs whose floating operands are all of one of ``dtypes`` (on the CPU) run as one
    fp32 GEMM of the upcast operands, rounded back to that dtype (see the module doc)."""

    def __init__(self, dtypes: frozenset[torch.dtype]) -> None:
        super().__init__()
        self.dtypes = dtypes
        self.calls = 0  # GEMMs computed wide (tests read it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in GEMM_OPS:
            dtype = _one_dtype(args)
            if dtype in self.dtypes:
                self.calls += 1
                pieces = _column_pieces(func, args, kwargs)
                if pieces is not None:
                    return torch.cat([self.__torch_dispatch__(func, types, a, k)
                                      for a, k in pieces], dim=-1)
                wide = tree_map(_upcast, (args, kwargs))
                return func(*wide[0], **wide[1]).to(dtype)
        return func(*args, **kwargs)


#: A right operand of more elements than this is computed in pieces of its columns (the
#: fp8 quantiser's piece, 64 MB of fp32 each): the upcast copy of an 8 B Llama's LM head
#: would be 2.1 GB.
PIECE = CHUNK


def _column_pieces(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """``mm(a, b)`` / ``addmm(bias, a, b)`` with a large ``b`` as the same op on pieces of
    ``b``'s columns (each output column's sum is computed whole, so the numbers are those
    of the whole GEMM); None for any other GEMM or a small ``b``."""
    if func is _aten.mm.default and not kwargs:
        a, b = args
        bias = None
    elif func is _aten.addmm.default and not kwargs and args[0].dim() <= 1:
        bias, a, b = args
    else:
        return None
    if b.dim() != 2 or b.numel() <= PIECE or b.shape[1] < 2:
        return None
    step = max(1, PIECE // max(1, b.shape[0]))
    out = []
    for j in range(0, b.shape[1], step):
        cols = slice(j, min(j + step, b.shape[1]))
        if bias is None:
            out.append(((a, b[:, cols]), {}))
        else:
            part = bias if bias.dim() == 0 or bias.shape[0] == 1 else bias[cols]
            out.append(((part, a, b[:, cols]), {}))
    return out


def _upcast(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in HALF_DTYPES else x


def _one_dtype(args: tuple[Any, ...]) -> torch.dtype | None:
    """The dtype of a GEMM's floating CPU operands when they all share one, else None."""
    seen: set[torch.dtype] = set()
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            if a.device.type != "cpu":
                return None
            seen.add(a.dtype)
    return next(iter(seen)) if len(seen) == 1 else None


def _matmul_s(dtype: torch.dtype, n: int = 256, reps: int = 3) -> float:
    a = torch.randn(n, n).to(dtype)
    a @ a  # warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def slow_dtypes() -> frozenset[torch.dtype]:
    """The 16-bit dtypes whose GEMMs this CPU runs more than ``SLOW_FACTOR`` x slower than
    fp32 (measured once per process, one torch thread), or as ``AUTOPREC_WIDE16`` forces."""
    forced = os.environ.get("AUTOPREC_WIDE16")
    if forced is not None:
        return frozenset(HALF_DTYPES) if forced.strip() not in ("", "0") else frozenset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _matmul_s(torch.float32)
        return frozenset(d for d in HALF_DTYPES if _matmul_s(d) > SLOW_FACTOR * fp32)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def scoring_gemms() -> Iterator[Wide16 | None]:
    """Score under ``Wide16`` for the dtypes this CPU is slow at (nothing when none)."""
    dtypes = slow_dtypes()
    if not dtypes:
        yield None
        return
    with Wide16(dtypes) as mode:
        yield mode


__all__ = ["GEMM_OPS", "PIECE", "SLOW_FACTOR", "Wide16", "scoring_gemms", "slow_dtypes"]
