"""A deploy-form plan whose rule cannot run is priced as unable to run (plan.schedule).

In the deploy form a module's output keeps the dtype its module gave it, so an attention
module ruled fp32 whose q / k / v Linears are ruled bf16 runs its SDPA in bf16: the rule
did not run, and the audit refuses it on a real forward. The replay says so before any
forward (compiled encoder4 tunes once spent every trial on such plans); the same rule
with q / k / v following it, and the training form (autocast casts the children's outputs
back), are priced as they run.
"""

from __future__ import annotations

import copy

import pytest

from autoprec.apply.apply import audit_policy
from autoprec.cost import CostModel, get_profile
from autoprec.policy import Policy
from autoprec.trace import trace
from tests import zoo

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
ATT = "encoder.layer.0.attention.self"


def _rules(children: str) -> dict[str, str]:
    return {ATT: "fp32", **{f"{ATT}.{n}": children for n in ("query", "key", "value")}}


@pytest.fixture(scope="module")
def case():
    c = zoo.bert()
    return c, CostModel(trace(c.model, c.batch, tracers=("hooks",)), get_profile("h100"))


def test_a_container_rule_its_16_bit_children_overrule_cannot_run_deployed(case) -> None:
    c, cost = case
    pol = Policy(default="bf16", layers=_rules("bf16"), form="deploy")
    why = cost.breakdown(pol).invalid
    assert why is not None and "scaled_dot_product_attention" in why and ATT in why
    assert "computes in bf16" in why and "its rule says fp32" in why
    m = copy.deepcopy(c.model)  # and the real forward's audit agrees
    report = audit_policy(m, pol, lambda: m(**c.batch), target="h100")
    assert any(ATT in e and "computed in bf16" in e for e in report.errors), report.errors


@pytest.mark.parametrize("pol", [
    Policy(default="bf16", layers=_rules("fp32"), form="deploy"),
    Policy(default="bf16", layers={ATT: "fp32"}, form="deploy"),
    Policy(default="bf16", layers=_rules("bf16"), form="train"),
], ids=["children-fp32", "children-inherit", "train-form"])
def test_the_rule_priced_where_it_runs(case, pol: Policy) -> None:
    c, cost = case
    assert cost.breakdown(pol).invalid is None
    m = copy.deepcopy(c.model)
    assert audit_policy(m, pol, lambda: m(**c.batch), target="h100").errors == []
