"""The audit of a real training step (``apply.audit_step``): every GEMM leaf's forward and
backward ran in its rule's precision — 16-bit gradient GEMMs in 16-bit regions, fp32 in
fp32 / tf32 ones, an fp8 leaf's gradient quantised to e5m2 — and a rule the backward breaks
is named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoprec.apply.audit_step import TrainingStep, audit_step
from autoprec.policy import Policy
from tests import zoo

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


def _mlp_step(model: torch.nn.Module) -> TrainingStep:
    x = torch.randn(16, 100)
    y = torch.randint(0, 10, (16,))
    return TrainingStep(model, lambda m, b: m(b[0]), lambda o, b: F.cross_entropy(o.float(), b[1]),
                        (x, y))


def test_every_rule_holds_in_forward_and_backward() -> None:
    model = zoo.mlp().model
    pol = Policy(default="bf16", layers={"fc1": "fp32", "fc2": "fp8", "head": "fp16"})
    fwd, bwd = audit_step(model, pol, _mlp_step(model), target="h100")
    assert fwd.ok, fwd.errors
    assert bwd.ok, bwd.errors
    rows = {r.layer: r for r in bwd.rows}
    assert rows["fc1"].computed == "fp32"  # its input needs no gradient: only its wgrad
    assert rows["fc1"].gemms == 1
    assert rows["fc2"].computed == "e5m2"  # the gradient quantised, as TE / torchao do
    assert rows["head"].computed == "fp16" and rows["head"].gemms == 2  # dgrad, wgrad
    assert all(p.grad is not None for p in model.parameters())


def test_gpt2_bf16_backward_is_bf16() -> None:
    case = zoo.gpt2()
    model = case.model
    fwd = case.forward or (lambda m, b: m(**b) if isinstance(b, dict) else m(b))
    step = TrainingStep(model, fwd, lambda o, b: getattr(o, "logits", o).float().mean(),
                        case.batch)
    f, b = audit_step(model, Policy(default="bf16"), step, target="h100")
    assert f.ok and b.ok, (f.errors, b.errors)
    assert {r.computed for r in b.rows} == {"bf16"}


def test_a_backward_that_breaks_the_rule_is_named() -> None:
    """A leaf whose backward upcasts its gradient (an autograd.Function of the model's own)
    runs fp32 gradient GEMMs under a bf16 rule: the backward audit names it."""

    class Up(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            x, w = ctx.saved_tensors
            g = g.float()
            return (g @ w.float()).to(x.dtype), (g.t() @ x.float()).to(w.dtype)

    class Odd(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Up.apply(x, self.weight.to(x.dtype))

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Odd(32, 16, bias=False))
    x = torch.randn(8, 32)
    step = TrainingStep(model, lambda m, b: m(b), lambda o, b: o.float().sum(), x)
    _, bwd = audit_step(model, Policy(default="bf16"), step, target="cpu")
    assert [e.split(":")[0] for e in bwd.errors] == ["1"]
    assert "computed in fp32" in bwd.errors[0]
