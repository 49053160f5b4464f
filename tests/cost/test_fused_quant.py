"""A fused runtime quantises a shared activation once: with ``shared_quant_inputs``
(``tune --fuse-groups auto``), GEMM-format leaves that read the same input pay its
quantisation passes once; without it, once each."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.cost import CostModel, get_profile
from autoprec.policy import Policy
from autoprec.trace import trace


class _QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(1024, 1024) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1024)
        return self.q(x) + self.k(x) + self.v(x)


def _model(shared: bool) -> CostModel:
    graph = trace(_QKV().eval(), torch.randn(64, 1024))
    cm = CostModel(graph, get_profile("h100"), batch_size=4096)
    cm.shared_quant_inputs = shared
    return cm


def _cost(shared: bool, rules: dict[str, str]) -> float:
    return _model(shared).estimate(Policy(default="bf16", form="deploy", layers=rules))


def _scaling(shared: bool, rules: dict[str, str]) -> float:
    pol = Policy(default="bf16", form="deploy", layers=rules)
    return _model(shared).breakdown(pol).parts["gemm_format_scaling"]


def test_a_shared_input_is_quantised_once() -> None:
    fp8 = {p: "fp8" for p in ("q", "k", "v")}
    apart, fused = _cost(False, fp8), _cost(True, fp8)
    one = _cost(False, {"q": "fp8"}) - _cost(True, {"q": "fp8"})
    assert one == 0.0  # one reader: nothing to share
    assert fused < apart
    # the input's quantisation passes: three of them apart, one fused (weights are
    # quantised once at apply, not per forward)
    one_pass = _scaling(False, {"q": "fp8"})
    assert one_pass > 0
    assert abs(_scaling(False, fp8) - 3 * one_pass) < 1e-12
    assert abs(_scaling(True, fp8) - one_pass) < 1e-12
    assert abs((apart - fused) - 2 * one_pass) < 1e-12
    # mixed formats do not share: fp8 and mxfp8 quantise differently
    mixed = {"q": "fp8", "k": "mxfp8", "v": "bf16"}
    assert _cost(True, mixed) == _cost(False, mixed)
