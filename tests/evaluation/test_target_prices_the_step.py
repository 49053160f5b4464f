"""What a target's speed figures price: the training step for the train form (given, or
written in the policy), the forward for a policy file without ``form:`` (written before the
deploy form and tuned for the forward: its recorded figures are the forward's)."""

from __future__ import annotations

import pytest

from autoprec.policy import Policy
from autoprec.pricing.target import resolve_target

BASE = {"autoprec_policy": 1, "default": "bf16", "target": "h100"}


@pytest.mark.parametrize(("written", "given", "step"), [
    (None, None, False),  # a file from before the deploy form: the forward it was tuned for
    ("train", None, True),  # the train form, written: the training step
    ("deploy", None, False),
    (None, "train", True),  # tune --form train / eval of a train-form run
    ("deploy", "train", True),
])
def test_the_step_is_priced_for_the_train_form(written, given, step):
    data = dict(BASE, **({"form": written} if written else {}))
    policy = Policy.from_dict(data)
    assert policy.form_written is (written is not None)
    target = resolve_target(None, policy, form=given)
    assert target.step is step
    assert target.form == (given or written or "train")


def test_a_policy_built_in_code_says_its_form():
    assert resolve_target("h100", Policy(default="bf16", form="train")).step is True
    assert resolve_target("h100", None, form="deploy").step is False
