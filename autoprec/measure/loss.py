"""The loss of a training step run here: model.py's ``loss`` forward and backward on the
model's output, per dtype the output may arrive in, its kernels counted and, on a CPU,
timed (``record_loss``). What it records (``cost.loss_step.LossKernels``) and how the step
prices it are the cost stage's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoprec.cost.loss_step import OUTPUT_DTYPES, LossKernel, LossKernels
from autoprec.measure.op_runner import PASSES, _time


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


def _storage_id(t: torch.Tensor) -> int:
    """Which storage ``t`` reads: its address, or on the meta device (a shape-only trace,
    ``trace.shape_only``: every address is 0) the storage object's own."""
    s = t.untyped_storage()
    return s._cdata if t.device.type == "meta" else s.data_ptr()


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


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a forward's result, a mapping's (HF ``ModelOutput``) values included."""
    found = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if isinstance(out, dict):
        found += [v for v in out.values() if isinstance(v, torch.Tensor)]
    return found


def _reads_output(loss: Callable[[Any, Any], torch.Tensor], out: Any, logits: torch.Tensor,
                  batch: Any) -> bool:
    """Whether ``loss(out, batch)`` is computed from the output's largest tensor: run on a
    copy of ``out`` whose ``logits`` is a leaf needing a gradient, its value needs one too.
    False for ``lambda out, batch: out.loss`` (HF, labels in the batch): a tensor of the
    output itself, computed inside the forward. model.py's checked loss is called unwrapped
    for this: its gradient check would refuse exactly that loss, which has no gradient under
    this no-grad forward; any other loss without a gradient is refused by that check."""
    raw = loss.__wrapped__ if getattr(loss, "__autoprec_checked__", False) else loss  # type: ignore[attr-defined]
    with torch.no_grad():
        loss(out, batch)  # checked: what it raised or returned, named in one line
    leaf = logits.detach().requires_grad_(True)
    with torch.enable_grad():
        value = raw(_replace(out, logits, leaf), batch)
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return True
    if any(t is value for t in _tensors(out)):  # the output's own loss (HF ``out.loss``)
        return False
    with torch.enable_grad():  # detached, or not of the outputs: the check refuses it
        loss(_replace(out, logits, leaf), batch)
    return True


def record_loss(net: torch.nn.Module, forward: Callable[[Any, Any], Any],
                loss: Callable[[Any, Any], torch.Tensor], batch: Any, *,
                measure: bool = False) -> LossKernels:
    """The loss's kernels forward and backward per output dtype (see the module docs), timed
    here too with ``measure`` (the caller holds torch at the timing threads)."""
    with torch.no_grad():
        out = forward(net, batch)
    logits = _output_tensor(out)
    got = LossKernels(int(logits.numel()))
    if not _reads_output(loss, out, logits, batch):
        # the model computed its loss itself (HF: labels in the batch, ``out.loss``): its
        # kernels ran in the forward and are priced with it; nothing more runs after it
        for name in OUTPUT_DTYPES:
            got.kernels[name], got.saved[name] = [], 0.0
            if measure:
                got.seconds[name] = 0.0
        return got
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
            if _storage_id(t) != _storage_id(leaf) and t.is_floating_point():
                kept[_storage_id(t)] = s.nbytes()
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




__all__ = ["record_loss"]
