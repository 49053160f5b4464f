"""The GEMM formats' own facts (autoprec.formats.gemm): alignment, Linear-likes, training,
and the modules torch.nn never calls — asked the same way by every stage."""

from __future__ import annotations

import pytest
from torch import nn

from autoprec.formats.gemm import GEMM_FORMAT_BY_NAME, eligible, ineligible_reason, linear_dims
from autoprec.precisions import GEMM_FORMATS


def test_one_object_per_gemm_format() -> None:
    assert tuple(GEMM_FORMAT_BY_NAME) == GEMM_FORMATS
    assert GEMM_FORMAT_BY_NAME["fp8"].block is None
    assert (GEMM_FORMAT_BY_NAME["mxfp8"].block, GEMM_FORMAT_BY_NAME["nvfp4"].block) == (32, 16)
    assert GEMM_FORMAT_BY_NAME["nvfp4"].gradient_recipe is None and GEMM_FORMAT_BY_NAME["mxfp8"].gradient_recipe


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
    why = ineligible_reason(nn.Linear(64, 32), "nvfp4", training=True)
    assert why is not None and "forward-only" in why
    with pytest.raises(ValueError, match="not a GEMM format"):
        ineligible_reason(nn.Linear(64, 32), "fp4")


@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_multihead_attention_out_proj_takes_no_format(fmt: str) -> None:
    """nn.MultiheadAttention never calls out_proj: no backend could run there."""
    out_proj = nn.MultiheadAttention(64, 4).out_proj
    why = ineligible_reason(out_proj, fmt)
    assert why is not None and "never calls out_proj" in why
    assert not eligible(out_proj, fmt)
