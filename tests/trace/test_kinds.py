"""Op-kind classification and per-precision eligibility, module by module."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.trace import trace
from autoprec.trace.kinds import classify, eligibility, format_reason, linear_dims


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class ManualAttention(nn.Module):
    """q @ k.T, softmax, @ v in its own code: no child modules at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        scores = x @ x.transpose(-1, -2) / x.shape[-1] ** 0.5  # (B, T, T)
        return scores.softmax(-1) @ x  # (B, T, C)


class Bilinear(nn.Module):
    """A parametric matmul that is not nn.Linear: GEMM, but no fp8 module backend."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_classify_by_type_and_own_ops() -> None:
    assert classify(nn.Linear(4, 4), {"addmm"}, False) == "linear"
    assert classify(nn.Conv1d(2, 2, 3), {"convolution"}, False) == "conv"
    assert classify(nn.Softmax(-1), {"_softmax"}, False) == "softmax"
    assert classify(nn.Identity(), set(), False) == "other"
    assert classify(Scale(), {"mul"}, False) == "elementwise"
    assert classify(nn.GELU(), {"gelu"}, False) == "activation"
    assert classify(nn.Dropout(), set(), False) == "dropout"
    assert classify(nn.RMSNorm(4), {"_fused_rms_norm"}, False) == "norm"
    assert classify(nn.Sequential(nn.Linear(2, 2)), {"add"}, True) == "container"
    assert classify(nn.Sequential(nn.Linear(2, 2)), {"bmm", "_softmax"}, True) == "attention"
    assert classify(Bilinear(), {"mm"}, False) == "matmul"


def test_functional_matmuls_make_attention_and_matmul_kinds() -> None:
    model = nn.Sequential(ManualAttention(), Bilinear())
    x = torch.randn(2, 4, 8)  # (B, T, C)
    g = trace(model, x)
    att, mm = g["0"], g["1"]
    assert att.kind == "attention" and att.is_leaf
    assert att.flops == 2 * (2 * 2 * 4 * 4 * 8)  # two (B, T, T, C) matmuls
    assert att.disallowed["fp8"].startswith("attention is not Linear-like")
    assert mm.kind == "matmul" and mm.flops == 2 * 2 * 4 * 8 * 8
    assert mm.allowed == ["fp32", "tf32", "bf16", "fp16"]
    assert g.edges == [("0", "1")]


def test_fp8_reasons() -> None:
    assert format_reason(nn.Linear(64, 32), "linear") is None
    assert format_reason(nn.Linear(100, 64), "linear") == "in_features 100 not a multiple of 16"
    assert format_reason(nn.Linear(100, 10), "linear") == (
        "in_features 100 not a multiple of 16, out_features 10 not a multiple of 16"
    )
    assert format_reason(nn.LayerNorm(16), "norm") == "not a GEMM"


def test_hf_conv1d_is_linear_like() -> None:
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(nf=48, nx=32)  # weight (nx, nf) = (in, out)
    assert linear_dims(conv) == (32, 48)
    assert classify(conv, {"addmm"}, False) == "linear"


def test_container_eligibility() -> None:
    only_bad = nn.Sequential(nn.Linear(100, 10))
    allowed, why = eligibility(only_bad, "container", set(), subtree_gemms=1,
                               subtree_formats={"fp8": 0})
    assert allowed == ["fp32", "tf32", "bf16", "fp16"]
    assert why == {"fp8": "no fp8-eligible Linear inside (both dims multiples of 16)",
                   "mxfp8": "no mxfp8-eligible Linear inside (block-aligned dims)",
                   "nvfp4": "no nvfp4-eligible Linear inside (block-aligned dims)"}
    no_gemm = nn.Sequential(nn.LayerNorm(4), nn.ReLU())
    allowed, why = eligibility(no_gemm, "container", set(), subtree_gemms=0)
    assert allowed == ["fp32"]
    assert why["bf16"] == "no autocast-eligible op inside (no matmul/conv runs in this module)"
    allowed, why = eligibility(nn.Softmax(-1), "softmax", {"_softmax"})
    assert why["fp16"] == "no autocast-eligible op (softmax runs in fp32 under autocast)"
