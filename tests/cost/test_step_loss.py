"""The loss and dropout in a training step's price, against a real step's own ops: the
loss's kernels (``cost.loss_step``) are those a real forward + backward runs outside the
model's modules, at the dtype the plan gives the output; the gradient GEMMs timed here
(``measure.measure_grads``) are what the step prices its dgrad and wgrad at. Counted by the
tests' own dispatch mode (``tests.helpers.op_count``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import StepPart
from autoprec.measure import measure_grads, record_loss
from autoprec.policy import Policy
from autoprec.trace import trace
from tests.helpers import one_torch_thread
from tests.helpers.op_count import OpCount

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.head = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 10)
        return self.head(torch.relu(self.fc1(x)))


def fwd(m: nn.Module, b: tuple) -> torch.Tensor:
    return m(b[0])


def ce(out: torch.Tensor, b: tuple) -> torch.Tensor:
    return F.cross_entropy(out.float(), b[1])


BATCH = (torch.randn(8, 16), torch.randint(0, 10, (8,)))


def _real_step(model: nn.Module, pol: Policy) -> OpCount:
    stack: list[str] = []
    hooks = []

    def leave(_m: nn.Module, _a: object, _o: object) -> None:
        stack.pop()

    for path, mod in model.named_modules():
        hooks += [mod.register_forward_pre_hook(lambda _m, _a, p=path: stack.append(p)),
                  mod.register_forward_hook(leave)]
    count = OpCount(stack)
    try:
        with apply_policy(model, pol, target="cpu"), count:
            value = ce(fwd(model, BATCH), BATCH)
            count.phase = "backward"
            value.backward()
    finally:
        for h in hooks:
            h.remove()
    return count


@pytest.mark.parametrize(("pol", "dtype"), [
    (Policy(default="fp32"), "fp32"), (Policy(default="bf16"), "bf16"),
    (Policy(default="bf16", layers={"head": "fp32"}), "fp32")])
def test_the_loss_priced_is_what_a_real_step_runs_after_the_model(pol: Policy,
                                                                   dtype: str) -> None:
    model = Net().eval()
    kernels = record_loss(model, fwd, ce, BATCH)
    real = _real_step(model, pol)
    mine = kernels.kernels[dtype]
    # the forward ops outside every module: the loss's (its cast to fp32 under bf16)
    assert real.names("forward", outside=True) == Counter(
        k.name for k in mine if k.phase == "forward")
    assert ("_to_copy" in real.names("forward", outside=True)) == (dtype == "bf16")
    # its backward kernels all run in the real backward
    assert not Counter(k.name for k in mine if k.phase == "backward") - real.names("backward")
    assert {"log_softmax_backward_data", "nll_loss_backward"} <= {
        k.name.lstrip("_") for k in mine if k.phase == "backward"}
    # priced at the output's dtype under the plan: a roofline on a remote profile
    prof = get_profile("h100")
    cost = CostModel(trace(model, BATCH, forward=fwd, tracers=("hooks",)), prof,
                     step=StepPart())
    before, acts = cost.breakdown(pol).total_s, cost.train_memory(pol).activations
    cost.step.set_loss(cost, kernels)
    # what it saves: log_softmax's fp32 result (8 x 10) at least, held as activations
    assert kernels.saved[dtype] >= 8 * 10 * 4
    assert cost.train_memory(pol).activations == pytest.approx(acts + kernels.saved[dtype])
    bd = cost.breakdown(pol)
    want = sum(k.bytes / prof.bandwidth + prof.launch_overhead_s for k in mine)
    assert bd.parts["loss"] == pytest.approx(want)
    assert bd.total_s == pytest.approx(before + want)


def test_a_timed_loss_is_priced_at_its_timing() -> None:
    model = Net().eval()
    with one_torch_thread():
        kernels = record_loss(model, fwd, ce, BATCH, measure=True)
    assert set(kernels.seconds) == {"fp32", "bf16", "fp16"}
    cost = CostModel(trace(model, BATCH, forward=fwd, tracers=("hooks",)),
                     get_profile("cpu"), step=StepPart())
    cost.step.set_loss(cost, kernels)
    assert cost.breakdown(Policy(default="bf16")).parts["loss"] == kernels.seconds["bf16"]
    assert cost.breakdown(Policy(default="fp32")).parts["loss"] == kernels.seconds["fp32"]


def test_gradient_gemms_are_priced_at_their_own_timings() -> None:
    model = Net().eval()
    graph = trace(model, BATCH, forward=fwd, tracers=("hooks",))
    with one_torch_thread():
        grads = measure_grads(graph.ops, graph.batch_size, ["bf16", "fp16"])
    gemms = [i for i, op in enumerate(graph.ops.ops) if op.kind == "gemm"]
    assert set(grads) == set(gemms)
    assert all(set(grads[i]) == {"dgrad", "wgrad"} for i in gemms)
    cost = CostModel(graph, get_profile("cpu"), step=StepPart(grad_times=grads))
    for prec in ("fp32", "bf16", "fp16"):
        bd = cost.breakdown(Policy(default=prec))
        # fc1's input is the model's: only the head has a dgrad
        assert bd.parts["dgrad"] == pytest.approx(grads[gemms[1]]["dgrad"][prec])


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 16)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # (B, 2, T, 8)
        return F.scaled_dot_product_attention(q, k, v)


def test_attention_backward_and_backward_casts_are_priced_at_this_machines_timings() -> None:
    model = Attn().eval()
    x = torch.randn(2, 8, 16)
    graph = trace(model, x, tracers=("hooks",))
    with one_torch_thread():
        grads = measure_grads(graph.ops, graph.batch_size, ["bf16"])
    att = [i for i, op in enumerate(graph.ops.ops) if op.kind == "attention"]
    assert len(att) == 1 and set(grads[att[0]]) == {"dgrad"}
    cost = CostModel(graph, get_profile("cpu"), step=StepPart(grad_times=grads))
    bd = cost.breakdown(Policy(default="bf16"))
    assert bd.parts["dgrad"] == pytest.approx(grads[att[0]]["dgrad"]["bf16"])
    # every cast of the backward says what it casts: the widths it is priced at match
    from autoprec.plan.backward import backward
    from autoprec.plan.dtype_codes import WIDTH

    casts = [k for k in backward(cost.schedule(Policy(default="bf16"))).kernels
             if k.what == "cast"]
    assert casts and all(k.cast is not None for k in casts)
    for k in casts:
        v, src, dst = k.cast
        assert [w[0] for _, w in k.terms] == [WIDTH[src[0]], WIDTH[dst[0]]]
