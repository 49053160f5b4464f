"""The compiled plan is the one resolver apply reads: its resolution of every module path
equals the policy-level rules (most specific path wins, formats only on eligible leaves,
a shared module one precision under every alias) on every zoo model."""

from __future__ import annotations

import pytest

from autoprec.plan.compile import compile_plan
from autoprec.policy import Policy
from autoprec.policy.resolve import resolve
from tests import zoo
from tests.apply.test_every_rule_runs import _mixed_policy

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


@pytest.mark.parametrize("name", ["mlp", "shared", "cnn", "nn_encoder", "mha", "bert", "gpt2"])
def test_plan_resolution_equals_the_rules(name: str) -> None:
    model = zoo.ALL[name]().model
    containers = [p for p, m in model.named_modules() if p and next(m.children(), None)]
    policies = [
        _mixed_policy(model),
        Policy(default="fp16"),
        Policy(default="bf16", layers={p: "fp32" for p in containers[:2]}),
        Policy(default="fp32", layers={p: "fp8" for p in containers[:1]}),
    ]
    for pol in policies:
        assert compile_plan(pol, model).resolution() == resolve(pol, model)
