"""One real forward recorded op by op: what the cost model re-prices under any plan.

The recorded program (``OpTrace``): every kernel-level op with the module whose own code ran
it, the tensors it read and wrote (as ``Value`` ids, so the data flow is explicit), and every
module call with its inputs and outputs. ``autoprec.trace.op_recorder.record_ops`` records it
on one fp32 forward (which ops are one op each, and the known limits, are documented there).
The plan stage (``autoprec.plan.schedule``) replays this program under a plan: it decides
the dtype every value carries, inserts the casts autocast and the plan's region boundaries
make, and the cost model prices each op at the bytes and FLOPs it really moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: dtype names used throughout the plan and cost stages.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float64: "fp64",
}
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        DTYPE_NAMES[getattr(torch, _n)] = "fp8"

#: Op kinds. "gemm": a matmul/conv; "attention": fused SDPA; "view": no kernel.
OP_KINDS = ("gemm", "attention", "embedding", "cast", "view", "pointwise", "factory")


@dataclass
class Value:
    """A tensor of the recorded forward."""

    numel: int
    dtype: str  # at trace time: fp32 / bf16 / fp16 / fp64 / fp8, or e.g. "int64", "bool"
    itemsize: int  # bytes per element at trace time (non-floating values keep it)
    source: str  # "input" | "param" | "op"
    scales: bool  # numel grows with the batch size
    ndim: int = 1
    param: str = ""  # parameter/buffer name, for params
    owners: tuple[str, ...] = ()  # params shared by several modules: every owner's path
    #: a parameter that requires grad (a training step computes its gradient, the
    #: optimizer keeps its state); buffers and frozen parameters do not
    trainable: bool = False


@dataclass
class Op:
    """One op of the recorded forward, attributed to the innermost executing module."""

    name: str  # function name (linear, scaled_dot_product_attention, to) or aten packet name
    kind: str  # one of OP_KINDS
    module: int  # index into OpTrace.modules; -1: outside every module
    inputs: tuple[int, ...]  # value ids of the tensors it read
    outputs: tuple[int, ...]  # value ids of the tensors it wrote
    flops: float = 0.0  # at the calibration batch
    fixed_dtype: str | None = None  # output dtype set by the op itself (casts, factories)
    like: int | None = None  # output dtype follows this value (type_as, in-place ops)
    weight: int | None = None  # gemm: the weight operand's value id (when a parameter)
    #: a cast to the 16-bit dtype a 16-bit model is stored in (``x.to(input_dtype)`` after
    #: an fp32 norm): the model's own dtype, which a plan changes — the deploy form's
    #: replay casts to the region's storage dtype instead of the traced one
    ambient: bool = False
    #: how to run this op alone (``measure.op_times`` times it on this machine): the function
    #: (``F.linear``, ``aten.add.Tensor``) and its arguments, tensors as their value id,
    #: shape, strides and dtype (``trace.op_recipes``); None where an argument cannot be rebuilt
    recipe: dict[str, Any] | None = None


@dataclass
class Call:
    """One module forward call: the values that went in and came out."""

    module: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()


@dataclass
class OpTrace:
    """The recorded program. ``events`` interleave ops and calls in execution order:
    ``(0, op index)``, ``(1, call index)`` = enter, ``(2, call index)`` = exit."""

    modules: list[str]
    values: list[Value] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)
    batch_size: int = 1
    #: per module, how it reads inputs of another dtype in the deploy form
    #: (``lower.stored.consumer_kind``: "norm", "weights" or "")
    consumers: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size, "modules": self.modules,
            "consumers": self.consumers,
            "values": [v.__dict__ for v in self.values],
            "ops": [o.__dict__ for o in self.ops],
            "calls": [c.__dict__ for c in self.calls],
            "events": self.events,
        }


__all__ = ["Call", "DTYPE_NAMES", "OP_KINDS", "Op", "OpTrace", "Value"]
