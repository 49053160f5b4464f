"""The GEMM formats' own facts (autoprec.formats.gemm): alignment, Linear-likes, training,
and the modules torch.nn never calls — asked the same way by every stage."""

from __future__ import annotations

import pytest
from torch import nn

from autoprec.formats.gemm import GEMM_FORMAT_BY_NAME, eligible, ineligible_reason, linear_dims
from autoprec.formats.precisions import GEMM_FORMATS


def test_one_object_per_gemm_format() -> None:
    assert tuple(GEMM_FORMAT_BY_NAME) == GEMM_FORMATS
    assert GEMM_FORMAT_BY_NAME["fp8"].block is None
    assert (GEMM_FORMAT_BY_NAME["mxfp8"].block, GEMM_FORMAT_BY_NAME["nvfp4"].block) == (32, 16)
    assert GEMM_FORMAT_BY_NAME["nvfp4"].gradient_recipe and GEMM_FORMAT_BY_NAME["mxfp8"].gradient_recipe


@pytest.mark.parametrize("fmt, k, n, expect", [
    ("fp8", 64, 32, None),
    ("fp8", 100, 64, "in_features 100 not a multiple of 16"),
    ("fp8", 64, 10, "out_features 10 not a multiple of 16"),
    ("mxfp8", 64, 32, None),
    ("mxfp8", 48, 32, "in_features 48 not a multiple of the block size 32"),
    ("mxfp8", 64, 24, "out_features 24 not a multiple of 16"),
    ("nvfp4", 64, 16, None),
    ("nvfp4", 40, 16, "in_features 40 not a multiple of the block size 16"),
    ("nvfp4", 48, 16, "in_features 48 not a multiple of 32 (fp4 packs two elements"),
    ("nvfp4", 64, 40, "out_features 40 not a multiple of 16"),
])
def test_alignment_rules(fmt: str, k: int, n: int, expect: str | None) -> None:
    why = ineligible_reason(nn.Linear(k, n), fmt)
    if expect is None:
        assert why is None and eligible(nn.Linear(k, n), fmt)
    else:
        assert why is not None and why.startswith(f"{fmt}: ") and expect in why


def test_linear_likes_training_and_unknown_formats() -> None:
    assert "LayerNorm is not a Linear-like GEMM" in ineligible_reason(nn.LayerNorm(64), "mxfp8")
    from transformers.pytorch_utils import Conv1D  # GPT-2's: Conv1D(nf=out, nx=in)

    assert linear_dims(Conv1D(32, 64)) == (64, 32)  # its weight is (in, out)
    assert ineligible_reason(Conv1D(32, 64), "mxfp8") is None
    assert ineligible_reason(nn.Linear(64, 32), "mxfp8", training=True) is None
    assert "reduces over N in blocks of 32" in ineligible_reason(
        nn.Linear(64, 48), "mxfp8", training=True)
    # nvfp4 trains (NVIDIA's recipe) where the input-gradient GEMM's N packs: N % 32
    assert ineligible_reason(nn.Linear(64, 32), "nvfp4", training=True) is None
    assert "reduces over N in blocks of 16" in ineligible_reason(
        nn.Linear(64, 48), "nvfp4", training=True)
    with pytest.raises(ValueError, match="not a GEMM format"):
        ineligible_reason(nn.Linear(64, 32), "fp4")


@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_multihead_attention_out_proj_takes_no_format(fmt: str) -> None:
    """nn.MultiheadAttention never calls out_proj: no backend could run there."""
    out_proj = nn.MultiheadAttention(64, 4).out_proj
    why = ineligible_reason(out_proj, fmt)
    assert why is not None and "never calls out_proj" in why
    assert not eligible(out_proj, fmt)


def test_each_format_knows_its_widths_and_training() -> None:
    from typing import get_args

    from autoprec.formats.precisions import BYTES, FORMATS, PRECISIONS, TOLERANCES, Precision

    f8, mx, nv = (GEMM_FORMAT_BY_NAME[n] for n in ("fp8", "mxfp8", "nvfp4"))
    # elements + one scale byte per block: mxfp8 1 + 1/32, nvfp4 1/2 + 1/16
    assert (f8.bytes_per_element, mx.bytes_per_element, nv.bytes_per_element) == \
        (1.0, 1.03125, 0.5625)
    assert (f8.element_bits, mx.element_bits, nv.element_bits) == (8, 8, 4)
    assert [f.forward_only for f in (f8, mx, nv)] == [False, False, False]
    assert [f.block_scaled for f in (f8, mx, nv)] == [False, True, True]
    assert f8.per_tensor_scaled and not mx.per_tensor_scaled
    # the precision tables read the objects; the Literal spells the same names
    for n, f in GEMM_FORMAT_BY_NAME.items():
        assert (BYTES[n], FORMATS[n], TOLERANCES[n]) == (f.bytes_per_element, f.numeric,
                                                          f.tolerance)
    assert get_args(Precision) == PRECISIONS


def test_the_formats_answer_for_a_precision_name() -> None:
    from autoprec.formats.gemm import (
        BLOCK_SCALED,
        format_of,
        is_block_scaled,
        is_forward_only,
    )

    assert format_of("bf16") is None and format_of("mxfp8") is GEMM_FORMAT_BY_NAME["mxfp8"]
    assert BLOCK_SCALED == ("mxfp8", "nvfp4")
    assert [is_forward_only(p) for p in ("fp32", "fp8", "mxfp8", "nvfp4")] == \
        [False, False, False, False]
    assert [is_block_scaled(p) for p in ("fp16", "fp8", "mxfp8", "nvfp4")] == \
        [False, False, True, True]


@pytest.mark.parametrize("fmt, eager, fused, kernels", [
    # n = 1000 bf16 elements (2 bytes), 1 GB/s, 1 us a launch; by hand:
    # fp8: amax (2 us read + 1 us launch), scale kernel (1 us), cast (2 us read + 1 us
    # write + 1 us launch) = 8 us; fused: 2 reads + 1 write = 1000 * (2 * 2 + 1) bytes
    ("fp8", 8e-6, 5000.0, [("amax", 2000.0), ("fp8_scale", 0.0), ("fp8_cast", 3000.0)]),
    # mxfp8: one fused pass, 2 us read + 1.03125 us write + 1 us launch
    ("mxfp8", 4.03125e-6, 3031.25, [("mxfp8_cast", 3031.25)]),
    # nvfp4: the tensor amax (3 us), then the block pass (2 + 0.5625 + 1 us)
    ("nvfp4", 6.5625e-6, 4562.5, [("amax", 2000.0), ("nvfp4_cast", 2562.5)]),
])
def test_quantisation_passes_cost_by_hand(fmt: str, eager: float, fused: float,
                                           kernels: list[tuple[str, float]]) -> None:
    f = GEMM_FORMAT_BY_NAME[fmt]
    assert f.quant_seconds(1000, 2.0, 1e9, 1e-6) == pytest.approx(eager, rel=1e-12)
    assert f.quant_bytes(1000, 2.0) == fused
    assert f.quant_kernels(1000.0, 2.0) == kernels


def test_shape_problems_list_every_misaligned_dim() -> None:
    assert GEMM_FORMAT_BY_NAME["fp8"].shape_problems(100, 10) == [
        "in_features 100 not a multiple of 16", "out_features 10 not a multiple of 16"]
    got = GEMM_FORMAT_BY_NAME["mxfp8"].shape_problems(48, 24)
    assert len(got) == 2 and got[0].startswith("in_features 48") and \
        got[1].startswith("out_features 24")
    assert GEMM_FORMAT_BY_NAME["nvfp4"].shape_problems(48, 32)[0].startswith(
        "in_features 48 not a multiple of 32 (fp4 packs two elements per byte; "
        "torch._scaled_mm needs the packed K 24")
    assert GEMM_FORMAT_BY_NAME["mxfp8"].shape_problems(64, 32, training=True) == []


def test_gradients_round_as_each_backward_reads_them() -> None:
    import torch

    from autoprec.formats.fp8 import E5M2, fake_quant_fp8
    from autoprec.formats.mx import fake_quant_mxfp8_padded

    g = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(GEMM_FORMAT_BY_NAME["fp8"].fake_quant_grad(g), fake_quant_fp8(g, E5M2))
    assert torch.equal(GEMM_FORMAT_BY_NAME["mxfp8"].fake_quant_grad(g),
                       fake_quant_mxfp8_padded(g))
    # nvfp4: 1x16 blocks along N (40 padded to 48), stochastic rounding from a fixed seed
    from autoprec.formats.nvfp4_train import fake_quant_nvfp4_padded

    nv = GEMM_FORMAT_BY_NAME["nvfp4"].fake_quant_grad(g)
    assert torch.equal(nv, fake_quant_nvfp4_padded(
        g, stochastic=True, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(nv, GEMM_FORMAT_BY_NAME["nvfp4"].fake_quant_grad(g))


def test_one_linear_like_predicate() -> None:
    from transformers.pytorch_utils import Conv1D

    from autoprec.formats.gemm import is_gemm_module, is_linear_like, stores_in_out

    mods = [nn.Linear(4, 4), Conv1D(4, 4), nn.Conv2d(4, 4, 3), nn.Bilinear(4, 4, 4),
            nn.LayerNorm(4)]
    assert [is_linear_like(m) for m in mods] == [True, True, False, False, False]
    assert [is_gemm_module(m) for m in mods] == [True, True, True, True, False]
    assert [stores_in_out(m) for m in mods] == [False, True, False, False, False]
