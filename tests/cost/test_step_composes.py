"""A cost model is a forward pricer plus, optionally, the training step: the compiled
forward and the step compose (``make_cost_model(mode="compile", step=True)``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.cost import get_profile, make_cost_model
from autoprec.cost.compiled import CompiledPricer
from autoprec.cost.step import STEP_PARTS, StepBreakdown, step_metrics
from autoprec.policy import Policy
from autoprec.trace import trace


@pytest.fixture(scope="module")
def graph():  # noqa: ANN201
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
    return trace(model, torch.randn(16, 32), tracers=("hooks",))


def test_compiled_step_prices_forward_compiled_and_the_backward(graph) -> None:  # noqa: ANN001
    prof = get_profile("h100")
    pol = Policy(default="bf16", form="train")
    step = make_cost_model(graph, prof, 4096, "compile", form="train", step=True)
    fwd = make_cost_model(graph, prof, 4096, "compile", form="train")
    eager_step = make_cost_model(graph, prof, 4096, "eager", form="train", step=True)
    assert isinstance(step.forward, CompiledPricer) and step.step is not None
    bd = step.breakdown(pol)
    assert isinstance(bd, StepBreakdown)
    assert bd.parts["dgrad"] > 0 and bd.parts["wgrad"] > 0 and bd.parts["optimizer"] > 0
    assert bd.total_s == pytest.approx(sum(bd.parts[p] for p in STEP_PARTS))
    assert step.estimate(pol) == pytest.approx(bd.total_s)
    # the step's forward is the compiled forward (replayed as a step runs it)
    assert bd.forward_s == pytest.approx(step.forward_breakdown(pol).total_s)
    assert step.estimate(pol) > fwd.estimate(pol) + bd.backward_s * 0.99
    # the compiled forward fuses what eager launches op by op: the steps differ there
    assert bd.forward_s != pytest.approx(eager_step.breakdown(pol).forward_s)
    assert step_metrics(bd)["est_dgrad_us"] > 0
    # a forward-only cost model has no training memory to give
    with pytest.raises(ValueError, match="training step"):
        fwd.train_memory(pol)


def test_with_profile_keeps_the_composition(graph) -> None:  # noqa: ANN001
    prof = get_profile("h100")
    cm = make_cost_model(graph, prof, 4096, "compile", form="train", step=True)
    same = cm.with_profile(prof)
    assert isinstance(same.forward, CompiledPricer) and same.step is cm.step
    pol = Policy(default="bf16", form="train")
    assert same.estimate(pol) == pytest.approx(cm.estimate(pol))
    slow = cm.with_profile(get_profile("t4"))
    assert slow.estimate(pol) > cm.estimate(pol)
