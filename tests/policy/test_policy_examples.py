"""The example policies in policies/examples/ load, validate against the zoo's models,
apply, and audit clean."""

from __future__ import annotations

import pytest
import torch

from autoprec.apply.apply import apply_policy
from autoprec.policy import PolicyWarning, load_policy
from tests import zoo
from tests.helpers import ROOT

pytestmark = pytest.mark.filterwarnings("ignore:.*structure is not checked:autoprec.policy.PolicyWarning")

EXAMPLES = ROOT / "policies" / "examples"
MODELS = {"bert_mixed.yaml": zoo.bert, "keep_fp32_islands.yaml": zoo.gpt2}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_example_policy_applies_and_audits_clean(name: str) -> None:
    case = MODELS[name]()
    with pytest.warns(PolicyWarning, match="fingerprint: missing"):
        pol = load_policy(EXAMPLES / name, model=case.model)
    with apply_policy(case.model, pol) as h, torch.no_grad():
        report = h.audit(lambda: case.model(**case.batch))
    assert report.ok, report.errors
    computed = {r.computed for r in report.rows if r.computed != "-"}
    assert len(computed) >= 2


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(MODELS)
