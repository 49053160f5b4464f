"""The shadow pass of a streamed model, one block at a time on the way back.

The whole-model shadow pass (``api._shadow_pass``) runs one forward with gradients, keeps
every probed call (its error in each precision, its gradient edge) and the autograd graph of
the whole model, then one backward per scalar (each random projection, the loss). Streamed,
that holds every block's activations and calls until the backward: on a Llama-8B-shaped
model in the training form (fp32, six precisions, 64 tokens) ~70 MB more per block, 2.3 GB
over 32 blocks. Here the peak is one block's:

1. **capture**: a forward without gradients, the probe hooks inert, keeps each block's
   inputs (the hidden state a block hands the next is ~1 MB at 64 tokens) and the last
   block's output;
2. **outside the blocks**: the model's own forward with the blocks stood in for (the first
   records the hidden state it is given, each returns the last block's output with its
   hidden state a fresh leaf): the modules before and after the blocks (embeddings, LM
   head) run and are probed; each scalar's backward stops at the leaf;
3. **the blocks, last first**: block i runs alone on its captured inputs (a fresh leaf for
   its hidden state), is probed, and each scalar's gradient at its output is carried back
   through it to its input, giving its calls' gradients on the way; its calls are consumed
   and dropped before block i-1 runs;
4. **before the blocks**: the gradients at the first block's input carried into the
   modules before it.

The gradient at a call's output is the whole model's: the chain rule split where the hidden
state passes from block to block, which must be the only path between blocks — checked on
the capture (block i+1 reads block i's output, the same argument of every block); a model
where it is not falls back to the whole-model pass (``shadow_batch`` returns None).
Sums of products are formed in another order, so they agree with the whole-model pass to
rounding (tests/probe/test_blockwise.py), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoprec.probe.grads import edge_grads_from
from autoprec.probe.shadow import Call, ShadowPass
from autoprec.stream.streamed import Inject, StreamedModel

#: ``consume(calls, grads)``: ``grads[k]`` the k-th scalar's gradients at the calls' outputs
#: (``grads.edge_grads``' form), None for a scalar that has none (it does not require grad)
Consume = Callable[[list[Call], list[list[list[Any]] | None]], None]


@dataclass
class _Chain:
    """What the capture found: each block's (args, kwargs), where the hidden state is in
    them (``slot``, in their flattened leaves) and in a block's output (``out_slot``)."""

    inputs: list[tuple[Any, Any]]
    slot: int
    out_slot: int
    last: Any  # the last block's output


def _capture(stream: StreamedModel, sp: ShadowPass, run: Callable[[], Any]) -> _Chain | None:
    """Step 1 (module doc); None when the blocks are not a chain of one hidden state."""
    n = len(stream.blocks)
    ins: list[Any] = [None] * n
    outs: list[Any] = [None] * n

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            ins[i] = (args, kwargs)
        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            outs[i] = out
        return hook

    handles = []
    for i, block in enumerate(stream.blocks):
        handles.append(block.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(block.register_forward_hook(post(i)))
    sp.busy = True
    try:
        with torch.no_grad():
            run()
    finally:
        sp.busy = False
        for h in handles:
            h.remove()
    if n < 2 or any(x is None for x in ins) or outs[-1] is None:
        return None
    slots = set()
    for i in range(1, n):
        leaves = tree_flatten(ins[i])[0]
        prev = tree_flatten(outs[i - 1])[0]
        hits = [(a, b) for a, t in enumerate(leaves) for b, o in enumerate(prev)
                if isinstance(t, torch.Tensor) and t is o]
        if len(hits) != 1:
            return None
        slots.add(hits[0])
    if len(slots) != 1:
        return None
    ((slot, out_slot),) = slots
    first = tree_flatten(ins[0])[0]
    if slot >= len(first) or not isinstance(first[slot], torch.Tensor) \
            or not first[slot].is_floating_point():
        return None
    # the hidden states kept are copies: nothing the model does later can change them
    inputs = [_with_slot(x, slot, tree_flatten(x)[0][slot].detach().clone()) for x in ins]
    return _Chain(inputs, slot, out_slot, outs[-1])


def _with_slot(tree: Any, slot: int, value: torch.Tensor) -> Any:
    leaves, spec = tree_flatten(tree)
    leaves[slot] = value
    return tree_unflatten(leaves, spec)


class _FirstBlock(nn.Module):
    """Stands for the first block in step 2: records the hidden state it is given (with its
    graph back to the embeddings) and the calls probed before it, returns ``output``."""

    def __init__(self, output: Any, slot: int, calls: Callable[[], int]) -> None:
        super().__init__()
        self.output, self.slot, self.calls = output, slot, calls
        self.given: torch.Tensor | None = None
        self.before = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.given = tree_flatten((args, kwargs))[0][self.slot]
        self.before = self.calls()
        return self.output


def shadow_batch(stream: StreamedModel, sp: ShadowPass, run: Callable[[], Any],
                 scalars_of: Callable[[Any], Sequence[torch.Tensor | None]],
                 consume: Consume, weights: bool = False) -> Any | None:
    """One batch of the shadow pass block by block (module doc): ``run()`` the model's
    forward, ``scalars_of(outputs)`` the scalars to differentiate, ``consume`` each group of
    calls with their gradients (``weights``: with its block loaded and its trained weights
    requiring grad, for the gradient probes' wgrad). Returns the model's outputs, or None
    when the model is not a chain of blocks (nothing consumed: the caller runs the
    whole-model pass)."""
    chain = _capture(stream, sp, run)
    if chain is None:
        return None
    n = len(stream.blocks)
    last = tree_flatten(chain.last)[0]
    leaf = last[chain.out_slot].detach().clone().requires_grad_(True)
    final = _with_slot(chain.last, chain.out_slot, leaf)
    first = _FirstBlock(final, chain.slot, lambda: len(sp.calls))
    with torch.enable_grad(), stream.blocks_replaced([first] + [Inject(final)
                                                                for _ in range(n - 1)]):
        out = run()
    calls = sp.take_calls()
    before, after = calls[:first.before], calls[first.before:]
    scalars = list(scalars_of(out))
    live = [k for k, s in enumerate(scalars) if s is not None and s.requires_grad]
    grads: list[Any] = [None] * len(scalars)
    at: dict[int, torch.Tensor | None] = {}  # scalar -> its gradient at the hidden state
    for k in live:  # the graph outside the blocks is kept for step 4
        grads[k], (at[k],) = edge_grads_from(scalars[k], None, after, [leaf], retain=True)
    _consume(consume, sp, after, grads, scalars)
    del after, grads
    for i in reversed(range(n)):
        given = tree_flatten(chain.inputs[i])[0][chain.slot].detach().requires_grad_(True)
        args, kwargs = _with_slot(chain.inputs[i], chain.slot, given)
        with torch.enable_grad(), stream.saving_weights_as_read():
            y = tree_flatten(stream.blocks[i](*args, **kwargs))[0][chain.out_slot]
        block_calls = sp.take_calls()
        grads = [None] * len(scalars)
        at = _carry(y, at, block_calls, given, grads)
        del y
        if weights:
            with stream.held(i, trained=True):
                _consume(consume, sp, block_calls, grads, scalars)
        else:
            _consume(consume, sp, block_calls, grads, scalars)
        del block_calls, grads
    if before and first.given is not None:
        grads = [None] * len(scalars)
        _carry(first.given, at, before, None, grads)
        _consume(consume, sp, before, grads, scalars)
    return out


def _carry(y: torch.Tensor, at: dict[int, torch.Tensor | None], calls: list[Call],
           given: torch.Tensor | None, grads: list[Any]) -> dict[int, torch.Tensor | None]:
    """Each scalar's gradient ``at[k]`` at ``y`` carried back through ``y``'s graph: into
    ``grads[k]`` at the calls' outputs; returns the gradients at ``given``."""
    ks = [k for k, g in at.items() if g is not None]
    out: dict[int, torch.Tensor | None] = {k: None for k in at}
    for idx, k in enumerate(ks):
        grads[k], back = edge_grads_from(y, at[k], calls, [given] if given is not None else [],
                                         retain=idx + 1 < len(ks))
        out[k] = back[0] if back else None
    return out


def _consume(consume: Consume, sp: ShadowPass, calls: list[Call], grads: list[Any],
             scalars: list[torch.Tensor | None]) -> None:
    if not calls:
        return
    # a scalar without gradients at these calls: every output's is None (edge_grads' form)
    full = [None if s is None else g if g is not None else [[None] * c.outputs for c in calls]
            for g, s in zip(grads, scalars)]
    sp.busy = True  # the gradient probes call layers whose children are hooked
    try:
        consume(calls, full)
    finally:
        sp.busy = False


__all__ = ["shadow_batch"]
