"""The per-block progress bar of a streamed model: one bar per stage over the blocks of the
forward running, nothing for a model in memory or with progress off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoprec.stream import open_streamed
from autoprec.stream.progress import block_progress
from tests.stream.test_streamed import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-llama")


def _forward(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_bar_counts_blocks_and_forwards(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = open_streamed(ckpt)
    seen: list[tuple[int, int]] = []
    model.autoprec_stream.on_block = lambda i, n: seen.append((i, n))
    with block_progress(model, "probe"):
        _forward(model)
        _forward(model)
    err = capsys.readouterr().err
    assert "probe: blocks" in err and "3/3" in err and "forward 2" in err
    assert seen == [(0, 3), (1, 3), (2, 3)] * 2  # the caller's own callback still told
    assert model.autoprec_stream.on_block is not None  # restored, not dropped
    model.autoprec_stream.on_block = None
    with block_progress(model, "probe"):
        pass
    assert model.autoprec_stream.on_block is None


def test_a_replayed_forward_counts_the_blocks_it_computes(
        ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = open_streamed(ckpt)
    st = model.autoprec_stream
    with block_progress(model, "probe"), st.replaying("as given", 2):
        _forward(model)  # computes blocks 0-2, keeps 0-1
        _forward(model)  # replays 0-1: computes block 2 alone
    err = capsys.readouterr().err
    assert "forward 2, from block 2" in err and "1/1" in err
    assert "4/3" not in err and "block [" not in err  # never past its total


def test_no_bar_with_progress_off_or_in_memory(ckpt: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = open_streamed(ckpt)
    with block_progress(model, "probe", enabled=False):
        _forward(model)
    plain = torch.nn.Linear(2, 2)
    with block_progress(plain, "probe"):
        plain(torch.zeros(1, 2))
    assert "blocks" not in capsys.readouterr().err
    assert model.autoprec_stream.on_block is None
