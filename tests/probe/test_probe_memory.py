"""The probes hold one batch's graph at a time, and nothing once done.

The shadow pass runs each batch with autograd on (the projections' backwards need it); a
batch's outputs, their graph and the per-call tensors must be gone before the next batch
(and after the probe) by reference counting alone: a reference cycle (a recursive
closure in ``_track_output`` was one) kept them until the cycle collector happened to run.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from autoprec.probe import probe, ranges
from autoprec.probe.ranges import TensorRange
from autoprec.trace import trace
from tests.helpers.new_bytes import NewBytes


class Recording(nn.Module):
    """Two Linears; each forward notes which earlier batches' activations are still alive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.alive_at_start: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 32) -> (B, 32)
        self.alive_at_start.append(sum(r() is not None for r in self.refs))
        h = torch.relu(self.fc1(x))
        y = self.fc2(h)
        self.refs += [weakref.ref(h), weakref.ref(y)]
        return y


def test_no_graph_outlives_its_batch_or_the_probe() -> None:
    model = Recording().eval()
    batches = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    graph = trace(model, batches[0], tracers=("hooks",))  # the trace's own forward aside
    model.refs.clear()
    model.alive_at_start.clear()
    gc.collect()
    gc.disable()  # what is freed must be freed by reference counting
    try:
        probe(model, batches, precisions=["bf16", "fp8"], e2e="none", progress=False,
              graph=graph)
        alive = [r() is not None for r in model.refs]
    finally:
        gc.enable()
    # the shadow pass's first forward of each batch sees no earlier batch's activations
    assert model.alive_at_start == [0, 0, 0, 0], model.alive_at_start
    assert not any(alive), alive


def test_the_probe_leaves_no_quantised_weight_on_the_model() -> None:
    model = Recording().eval()
    batches = [torch.randn(4, 32, generator=torch.Generator().manual_seed(0))]
    probe(model, batches, precisions=["fp8"], e2e="all", progress=False)
    left = [(n, k) for n, m in model.named_modules() for k in m.__dict__
            if k.startswith("_autoprec_") and "weight" in k]
    assert left == []


def test_a_large_tensors_range_is_counted_in_pieces_with_the_same_counts(monkeypatch) -> None:
    # An 8 B Llama's LM head (525 M values) counted whole held its fp32 magnitudes and their
    # int64 bucket indices: ~6 GB at once. In pieces, each op allocates at most one piece's
    # indices, and the counts are the whole tensor's.
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(101, 97, generator=g) * torch.logspace(-30, 6, 97)).to(torch.bfloat16)
    t[3, 5], t[50, 7], t[90, 1] = float("inf"), float("nan"), 0.0
    precisions = ["fp16", "bf16", "fp8"]
    whole = TensorRange()
    whole.add([t], precisions)
    monkeypatch.setattr(ranges, "CHUNK", 1000)
    mode = NewBytes()
    pieces = TensorRange()
    with mode:
        pieces.add([t], precisions)
    assert pieces == whole
    assert whole.nonfinite == 2 and whole.overflow["fp16"] > 0 and whole.underflow["fp16"] > 0
    assert mode.largest <= 1000 * 8, mode.largest  # one piece's int64 indices
