"""The streamed shadow pass backward a block at a time (``probe.blockwise``) against the
whole-model pass on the loaded model: the same table, up to rounding in the sums of
products; no more than one block's calls alive at once. (The whole-model pass on the
streamed model ran the gradient probes on blocks already offloaded: inf and NaN.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autoprec.probe import probe
from autoprec.probe.grads import Projections
from autoprec.stream import open_streamed
from autoprec.workload.checkpoint_spec import checkpoint_spec
from tests.stream.test_streamed import loaded, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bw") / "tiny-llama", layers=3, seed=2)


def _loss(out: Any, batch: Any) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


def _table(ckpt: Path, monkeypatch: pytest.MonkeyPatch, streamed: bool,
           alive: list[int]) -> Any:
    batches = checkpoint_spec(ckpt, seq_len=32, batches=2).calibration_batches()
    add = Projections.add

    def counting(self: Projections, calls: Any, grads: Any, weight: float = 1.0) -> None:
        alive.append(len(calls))
        add(self, calls, grads, weight)

    monkeypatch.setattr(Projections, "add", counting)
    # a training tune's fp32 masters, streamed or loaded whole
    model = open_streamed(ckpt, torch.float32) if streamed else loaded(ckpt, torch.float32)
    table = probe(model, batches, ["tf32", "bf16", "fp16", "fp8", "mxfp8"], loss=_loss,
                  e2e="none", progress=False, probes=2)
    monkeypatch.undo()
    return table.to_frame().set_index(["layer", "precision"]).sort_index()


def test_block_by_block_is_the_loaded_models_whole_pass(ckpt: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    at_once: list[int] = []
    whole = _table(ckpt, monkeypatch, False, at_once)
    per_block: list[int] = []
    blocks = _table(ckpt, monkeypatch, True, per_block)
    assert list(whole.index) == list(blocks.index)
    # every layer's own error and ranges: computed from the same inputs, the same numbers
    for col in ("local_error", "max_abs", "in_max_abs", "w_max_abs", "in_underflow_frac",
                "out_overflow", "calls"):
        assert whole[col].equals(blocks[col]), col
    # the gradient-carried sums: the same products summed in another order
    for col in ("cheap_estimate", "loss_effect", "grad_error", "grad_underflow"):
        a, b = whole[col].to_numpy(float), blocks[col].to_numpy(float)
        assert a == pytest.approx(b, rel=1e-4, abs=1e-9, nan_ok=True), col
    # the whole-model pass holds all 25 probed calls (3 blocks x 8: q, k, v, o, the
    # attention, gate, up, down; and the LM head) per backward; block by block one block's 8
    assert max(at_once) == 25
    assert max(per_block) == 8 and sum(per_block) == sum(at_once)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + x


class _Net(torch.nn.Module):
    """Blocks chained through ``h``, or (``chained=False``) each fed the model's input."""

    def __init__(self, chained: bool) -> None:
        super().__init__()
        self.chained = chained
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.blocks:
            h = b(h if self.chained else x, x=x)
        return h


@pytest.mark.parametrize("chained", [True, False])
def test_the_capture_finds_the_hidden_state_or_declines(chained: bool) -> None:
    """A model whose blocks hand one hidden state on is captured (its slot found); one
    whose blocks read something else gets None: the caller runs the whole-model pass."""
    from types import SimpleNamespace

    from autoprec.probe.blockwise import _capture

    net, x = _Net(chained), torch.randn(2, 4)
    sp = SimpleNamespace(busy=False)
    chain = _capture(SimpleNamespace(blocks=net.blocks), sp, lambda: net(x))  # type: ignore[arg-type]
    assert sp.busy is False
    if not chained:
        assert chain is None
        return
    assert chain is not None and (chain.slot, chain.out_slot) == (0, 0)
    assert len(chain.inputs) == 3 and torch.equal(chain.inputs[0][0][0], x)
