"""One count of what a real run executes, op by op: the dispatch mode the "what runs is
priced" tests compare the cost model with (written here, not from the pricer's code).

``OpCount`` records every aten op run inside it (``CountedOp``: its name, the phase the test
set — forward, backward, optimizer —, its operands' and results' dtypes, the bytes it moves,
a GEMM's FLOPs and the module it ran in, from a stack the test keeps with hooks). Views
(no kernel) are marked, and a ``_to_copy`` that keeps the dtype is no cast. Each test reads
the part it compares: GEMMs by dtype and FLOPs, casts, bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: aten GEMMs (packet names) and their FLOPs' operands
MM = frozenset({"mm", "addmm", "bmm", "baddbmm"})
GEMMS = MM | {"convolution", "_convolution"}


@dataclass(frozen=True)
class CountedOp:
    name: str  # aten packet name
    phase: str
    ins: tuple[torch.dtype, ...]  # floating operands' dtypes
    outs: tuple[torch.dtype, ...]
    first: torch.dtype | None  # the first operand's dtype (floating or not)
    in_dim: int  # the first operand's dimensions (-1: none)
    bytes: int  # elements read and written, at most each storage (a broadcast reads it once)
    flops: float  # a GEMM's 2 m k n per batch (0 for convolutions and the rest)
    where: str | None  # the innermost module path (None: outside every module)
    view: bool

    @property
    def cast(self) -> bool:
        """A real cast: ``_to_copy`` changing the dtype."""
        return self.name == "_to_copy" and self.first is not None and bool(self.outs) and \
            self.first != self.outs[0]

    @property
    def dtypes(self) -> str:
        """The GEMM's operand dtypes, e.g. "bf16" or "bf16,fp32"."""
        return ",".join(sorted({NAMES.get(d, str(d)) for d in self.ins}))


def _nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _flops(name: str, args: tuple) -> float:
    if name in ("mm", "bmm"):
        a, b = args[0], args[1]
    elif name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    else:
        return 0.0
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class OpCount(TorchDispatchMode):
    """Every op run inside, in order (``ops``); ``phase`` and ``stack`` are the test's.
    ``skip[0] > 0`` leaves ops out (an emulated backend's insides a GPU does not run)."""

    def __init__(self, stack: list[str] | None = None, skip: list[int] | None = None) -> None:
        super().__init__()
        self.phase = "forward"
        self.stack = stack if stack is not None else []
        self.skip = skip if skip is not None else [0]
        self.ops: list[CountedOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.skip[0]:
            return out
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        schema = func._schema
        view = any(r.alias_info is not None for r in schema.returns) and not schema.is_mutable
        nbytes = (2 * sum(t.numel() * t.element_size() for t in outs) if name == "embedding"
                  else sum(_nbytes(t) for t in (*ins, *outs)))  # embedding: the rows gathered
        self.ops.append(CountedOp(
            name, self.phase, tuple(t.dtype for t in ins if t.is_floating_point()),
            tuple(t.dtype for t in outs), ins[0].dtype if ins else None,
            ins[0].dim() if ins else -1, nbytes, _flops(name, args) if name in MM else 0.0,
            self.stack[-1] if self.stack else None, view))
        return out

    def kernels(self, phase: str | None = None) -> list[CountedOp]:
        """The ops that launch a kernel (no views, no same-dtype copies), of ``phase``."""
        return [o for o in self.ops if not o.view and (phase is None or o.phase == phase)
                and not (o.name == "_to_copy" and not o.cast)]

    def gemms(self, phase: str) -> Counter:
        """(operand dtypes, FLOPs) of the aten matmuls of ``phase``."""
        return Counter((o.dtypes, o.flops) for o in self.ops if o.phase == phase and o.name in MM)

    def casts(self, phase: str, min_dim: int = 0) -> int:
        return sum(1 for o in self.ops if o.phase == phase and o.cast and o.in_dim >= min_dim)

    def names(self, phase: str, outside: bool = False) -> Counter:
        """Kernel names of ``phase`` (``outside``: only those run outside every module)."""
        return Counter(o.name for o in self.kernels(phase) if not outside or o.where is None)
