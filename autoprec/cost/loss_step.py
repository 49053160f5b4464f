"""The loss of a training step, priced from the ops it really runs: model.py's ``loss``
forward and backward on the model's output.

The recorded forward (``trace``) ends at the model's output; a training step goes on with
``loss(outputs, batch)`` and its backward — for a cross-entropy: the output's cast to fp32
where it arrives 16-bit (``outputs.float()``), ``log_softmax`` (read the logits, write their
log-probabilities), ``nll_loss`` (gather one per row), then ``nll_loss_backward`` (a zeroed
gradient of the logits' size, one value scattered per row), ``log_softmax_backward`` (read
that and the saved log-probabilities, write the logits' gradient) and the cast back. The
logits of a language model are the largest activation of the step (GPT-2's 8 x 128 tokens
x 50 k vocabulary: 200 MB in fp32), so these passes are not small.

``record_loss(net, forward, loss, batch)`` runs the loss once per dtype the model's output
may arrive in (fp32, bf16, fp16), on a leaf tensor holding the real output in that dtype,
and keeps every kernel it launched forward and backward (``LossKernels``: aten ops other
than views, with the bytes each reads and writes). With ``measure`` (a local CPU target) it
also times that loss forward + backward here, per dtype, as ``cost.op_times`` times an op
(one thread, thread CPU time, the median of interleaved passes). ``StepCostModel.loss``
prices a plan's loss at the dtype the plan's replay gives the output: the timing where
there is one, else each kernel's roofline (``bytes / bandwidth + launch``); both scaled
linearly from the recorded batch to the priced one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoprec.plan.dtype_codes import DTYPES
from autoprec.trace.ops import OpTrace

#: The dtypes a model's output may arrive in (the plan stage's names).
OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LossKernel:
    """One kernel of the loss: its aten op, forward or backward, bytes read and written."""

    name: str
    phase: str  # "forward" | "backward"
    bytes: float


@dataclass
class LossKernels:
    """The loss's kernels per output dtype, and its measured seconds where timed here."""

    numel: int  # elements of the model's output the loss reads (at the recorded batch)
    kernels: dict[str, list[LossKernel]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # forward + backward, timed
    #: bytes the loss's autograd nodes save for its backward (log_softmax's result, ...),
    #: per output dtype, the model's output itself not counted
    saved: dict[str, float] = field(default_factory=dict)

    def table(self, bandwidth: float, launch: float) -> np.ndarray:
        """Seconds of the loss (forward + backward) by dtype code (``plan.dtype_codes``):
        measured where timed, else the roofline of its kernels; NaN for a dtype not run."""
        out = np.full(len(DTYPES), math.nan)
        for d, ks in self.kernels.items():
            out[DTYPES.index(d)] = self.seconds.get(
                d, sum(k.bytes / bandwidth + launch for k in ks))
        return out


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves for ``t``: its elements, at most its storage (a broadcast
    operand reads its storage once)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class _Count(TorchDispatchMode):
    """Every kernel (non-view aten op) run inside, with its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.kernels: list[LossKernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None for r in schema.returns) and not schema.is_mutable:
            return out  # a view: no kernel
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func.overloadpacket.__name__ == "_to_copy" and ins and outs and \
                ins[0].dtype == outs[0].dtype:
            return out  # a no-op copy
        self.kernels.append(LossKernel(func.overloadpacket.__name__, self.phase,
                                       float(sum(_nbytes(t) for t in (*ins, *outs)))))
        return out


def _output_tensor(out: Any) -> torch.Tensor:
    """The floating tensor of a forward's result the loss differentiates (the largest)."""
    ts = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not ts:
        raise ValueError("the forward returned no floating tensor to take a loss of")
    return max(ts, key=lambda t: t.numel())


def _replace(out: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """``out`` with tensor ``old`` replaced by ``new`` (a tensor, or a tuple / list / dict of
    them; an object with attributes, such as a HF ``ModelOutput``, as a dict)."""
    if out is old:
        return new
    if isinstance(out, (list, tuple)):
        return type(out)(_replace(x, old, new) for x in out)
    if isinstance(out, dict):
        got = {k: _replace(v, old, new) for k, v in out.items()}
        try:
            return type(out)(**got)
        except TypeError:
            return got
    return out


def record_loss(net: torch.nn.Module, forward: Callable[[Any, Any], Any],
                loss: Callable[[Any, Any], torch.Tensor], batch: Any, *,
                measure: bool = False) -> LossKernels:
    """The loss's kernels forward and backward per output dtype (see the module docs), timed
    here too with ``measure`` (the caller holds torch at the timing threads)."""
    from autoprec.cost.op_runner import PASSES, _time

    with torch.no_grad():
        out = forward(net, batch)
    logits = _output_tensor(out)
    got = LossKernels(int(logits.numel()))
    runs: dict[str, Callable[[], None]] = {}
    for name, dt in OUTPUT_DTYPES.items():
        leaf = logits.detach().to(dt).requires_grad_(True)
        feed = _replace(out, logits, leaf)

        def run(leaf: torch.Tensor = leaf, feed: Any = feed) -> None:
            leaf.grad = None
            loss(feed, batch).backward()

        count = _Count()
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor, leaf: torch.Tensor = leaf, kept: dict = kept) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() != leaf.untyped_storage().data_ptr() and t.is_floating_point():
                kept[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), count:
            value = loss(feed, batch)
        with count:
            count.phase = "backward"
            value.backward()
        got.kernels[name] = count.kernels
        got.saved[name] = float(sum(kept.values()))
        runs[name] = run
    if measure:
        passes: dict[str, list[float]] = {d: [] for d in runs}
        for _ in range(PASSES):  # interleaved, as cost.op_measure times ops
            for d, run in runs.items():
                passes[d].append(_time(run))
        got.seconds = {d: float(np.median(v)) for d, v in passes.items()}
    return got


def output_value(trace: OpTrace, numel: int) -> int | None:
    """The value id of the model's output the loss reads: among the outermost call's
    outputs, the floating one of ``numel`` elements (the last such op output otherwise)."""
    vals = trace.values
    outer = [c for c in trace.calls if c.module == 0] or trace.calls[:1]
    for c in reversed(outer):
        for v in reversed(c.outputs):
            if vals[v].numel == numel and vals[v].dtype in OUTPUT_DTYPES:
                return v
    for op in reversed(trace.ops):
        for v in op.outputs:
            if vals[v].numel == numel and vals[v].dtype in OUTPUT_DTYPES:
                return v
    return None


__all__ = ["LossKernel", "LossKernels", "OUTPUT_DTYPES", "output_value", "record_loss"]
