"""The deploy form quantises a large weight a piece of rows at a time (lower.stored).

An 8 B Llama's LM head is 525 M values: quantised whole from an fp32 copy it held 2.1 GB
more than the model while a plan was applied. Each format's scales run along K within a
row (nvfp4's one tensor scale is taken first), so the pieces give the whole's numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoprec.formats.fp8 as fp8
from autoprec.lower.blockscale import _fake_quant, _quantize_weight
from autoprec.lower.stored import stored_weight
from tests.helpers.new_bytes import NewBytes


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_a_weight_quantised_in_pieces_of_rows_is_the_whole_ones(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 103, bias=False)
    with torch.no_grad():  # rows of very different magnitudes: per-row blocks must not mix
        lin.weight.copy_(torch.randn(103, 64, generator=g) * torch.logspace(-4, 3, 103)[:, None])
    lin = lin.to(torch.bfloat16)
    whole_q, whole_s = stored_weight(lin, fmt, "emulated")
    monkeypatch.setattr(fp8, "CHUNK", 64 * 10)  # ten rows a piece: 11 pieces
    assert len(fp8.row_chunks(lin.weight)) == 11
    with NewBytes() as mode:
        q, s = stored_weight(lin, fmt, "emulated")
    assert mode.largest < lin.weight.numel() * 4, mode.largest  # no fp32 copy of the whole
    assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8))
    assert whole_s.keys() == s.keys()
    assert all(torch.equal(s[k].float(), whole_s[k].float()) for k in s)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_the_probes_emulated_weight_is_fake_quantised_in_pieces_of_rows(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lowered call's weight (``blockscale``, the probes' shadow runs): the values of a
    whole-tensor fake-quant, with no whole-size temporary beside the fp32 result."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(103, 64, generator=g) * torch.logspace(-4, 3, 103)[:, None]
    whole = _fake_quant(w, fmt)
    monkeypatch.setattr(fp8, "CHUNK", 64 * 10)
    with NewBytes() as mode:
        pieces = _quantize_weight(w, fmt, "emulated")
    assert torch.equal(pieces, whole)
    # the result itself is one whole fp32 tensor; nothing else that large is allocated
    assert mode.largest == w.numel() * 4, mode.largest
    assert mode.second < w.numel() * 4, mode.second
