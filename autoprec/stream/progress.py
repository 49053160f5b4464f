"""A progress bar over the blocks of a streamed model, one per stage of a tune.

A streamed forward reads its blocks one after another (``StreamedModel.on_block(i, n)`` is
told as block ``i`` of ``n`` starts); on an 8 B model a forward takes minutes on a CPU, so
``block_progress(model, "probe")`` shows a tqdm bar ``probe: blocks`` over the ``n`` blocks
of the forward now running (its rate, seconds per block, and the time left in that
forward), with the number of forwards the stage has run so far. A forward that replays
its first blocks (``StreamedModel.replaying``) starts at a later block: its bar counts the
blocks it computes and says where it started. A model held in memory,
or ``enabled=False`` (``progress=False``, ``--quiet``, ``--json``), shows nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from autoprec.stream.streamed import stream_of


@contextlib.contextmanager
def block_progress(model: nn.Module, stage: str, enabled: bool = True) -> Iterator[None]:
    """While open, each block a streamed ``model`` loads advances a bar named after
    ``stage`` (module doc); restores the previous ``on_block`` on exit."""
    stream = stream_of(model)
    if stream is None or not enabled:
        yield
        return
    from tqdm.auto import tqdm

    n = len(stream.blocks)
    bar: Any = tqdm(total=n, desc=f"{stage}: blocks", unit="block", leave=False)
    forwards = [0]
    last = [-1]  # the block the bar saw last: a block not after it starts a new forward
    before = stream.on_block

    def on_block(i: int, total: int) -> None:
        if i <= last[0] or forwards[0] == 0:
            forwards[0] += 1
            if forwards[0] > 1 or i > 0:
                bar.reset(total=total - i)
            # drawn now: once per forward
            bar.set_postfix_str(f"forward {forwards[0]}" + (f", from block {i}" if i else ""))
        last[0] = i
        bar.update(1)
        if i == total - 1:
            bar.refresh()  # a forward's end is drawn whatever tqdm's interval says
        if before is not None:
            before(i, total)

    stream.on_block = on_block
    try:
        yield
    finally:
        stream.on_block = before
        bar.close()


__all__ = ["block_progress"]
