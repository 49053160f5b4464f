"""A plan runs the kernels ``model.to(bf16)`` and one global ``torch.autocast`` run.

aten's matmul folds a 3-D input into one mm only when the weight requires grad; a frozen
16-bit copy (the deploy form's stored weight, or autocast's per-call cast under
``no_grad`` with its cache off) sends a non-contiguous input — MultiheadAttention's
batch_first projections — to bmm over the weight expanded per batch row. On this team's
AMD EPYC (AVX512-BF16) that made examples/nn_transformer 0.73x (deploy) and 0.67x
(autocast) of fp32 where ``model.to(bf16)`` runs 1.6x and the global autocast 1.5x.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec.apply.apply import apply_policy
from autoprec.policy import Policy
from tests.apply.test_apply_boundaries import tied_case, twice_case


class Transposed(nn.Module):
    """A Linear fed a transposed 3-D tensor, as MultiheadAttention(batch_first) feeds one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.transpose(0, 1))


def aten_ops(run: Callable[[], Any]) -> list[str]:
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        run()
    return seen


@pytest.mark.parametrize("form", ["train", "deploy"])
def test_a_transposed_input_runs_one_mm_as_under_model_to(form: str) -> None:
    torch.manual_seed(0)
    m = Transposed().eval()
    x = torch.randn(4, 8, 16)
    low = copy.deepcopy(m).to(torch.bfloat16)
    with torch.no_grad():
        plain = aten_ops(lambda: low(x.bfloat16()))
    assert "bmm" not in plain and {"mm", "addmm"} & set(plain), plain  # the fold
    with apply_policy(m, Policy(default="bf16", form=form), target="cpu"), torch.no_grad():
        got = aten_ops(lambda: m(x))
    assert "bmm" not in got, got
    assert {"mm", "addmm"} & set(got), got


def test_the_deploy_form_keeps_each_parameters_requires_grad() -> None:
    m = Transposed()
    m.lin.bias.requires_grad_(False)
    with apply_policy(m, Policy(default="bf16", form="deploy"), target="cpu"):
        assert m.lin.weight.dtype == torch.bfloat16
        assert m.lin.weight.requires_grad and not m.lin.bias.requires_grad


@pytest.mark.parametrize("case", [
    lambda: tied_case("bf16", "fp32"),  # one 16-bit dtype: autocast's cast cache on
    lambda: tied_case("bf16", "bf16"),  # bf16 and fp16 on one weight: the cache stays off
    lambda: twice_case("bf16", "fp16"),  # one module in fp16 and bf16 calls
    lambda: twice_case("bf16", "fp32"),
])
def test_no_grad_computes_what_the_checked_forward_computes(case: Callable[[], Any]) -> None:
    """tests/apply/test_apply_boundaries.py checks these plans against hand references with
    grad on; under no_grad (where the cast cache may be on) the outputs are the same."""
    m, pol, _ = case()
    x = torch.randn(2, 4, m.t1.in_features if hasattr(m, "t1") else m.lin.in_features)
    with apply_policy(m, pol, target="cpu"):
        want = m(x).detach()
        with torch.no_grad():
            got = m(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
