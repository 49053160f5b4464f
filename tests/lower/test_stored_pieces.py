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
import autoprec.lower.blockscale as blockscale
from autoprec.lower.blockscale import _fake_quant, _quantize_weight, blockscaled_linear
from autoprec.lower.fp8 import drop_weight_caches
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
def test_the_emulated_gemms_large_weight_is_kept_quantised_in_pieces_of_rows(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``blockscale``'s emulated GEMM (the probes' shadow runs): a weight of several pieces
    is quantised and kept a piece of rows at a time, no whole-size temporary; its values
    are the whole tensor's fake-quant's, and the GEMM's output theirs up to the last bits
    (smaller GEMMs may sum in another order)."""
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 103, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(103, 64, generator=g) * torch.logspace(-4, 3, 103)[:, None])
    x = torch.randn(5, 64, generator=g)
    whole = _fake_quant(lin.weight.detach(), fmt)
    want = blockscaled_linear(lin, x, fmt)
    drop_weight_caches(lin)
    monkeypatch.setattr(fp8, "CHUNK", 64 * 10)
    monkeypatch.setattr(blockscale, "PIECES_FROM", 64 * 10)
    with NewBytes() as mode:
        pieces = _quantize_weight(lin.weight, fmt, "emulated")
    assert len(pieces.rows) == 11
    assert torch.equal(torch.cat([pieces.dequantized(i) for i in range(len(pieces.rows))]),
                       whole)
    assert mode.largest < lin.weight.numel() * 4, mode.sizes
    with NewBytes() as mode:
        got = blockscaled_linear(lin, x, fmt)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert mode.largest < lin.weight.numel() * 4, mode.sizes
