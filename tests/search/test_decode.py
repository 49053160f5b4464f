"""The one decoder (search/decode.py): trial params -> key -> rules -> the same plan.

Every plan of a small space goes through params -> key -> explicit rules -> compact rules,
and back; the compact rules must run the plan the explicit ones run (the same schedule:
``plan.schedule.same_as``, what "the same plan" means) and give every GEMM layer the
precision the key says.
"""

from __future__ import annotations

import numpy as np

from autoprec.formats.precisions import PRECISIONS
from autoprec.plan.compile import assignment
from autoprec.plan.schedule import replay, same_as
from autoprec.policy import Policy
from autoprec.policy.build import plan_id
from autoprec.search.decode import TrialDecoder
from autoprec.search.plan_score import PlanScore
from autoprec.search.planner import enumerate_keys
from autoprec.search.select import Candidate
from tests.search.test_planner import _setup


def _key_of_rules(space, default: str, layers: dict[str, str]) -> tuple[int, ...]:
    """The key an explicit rule set says (the inverse of ``TrialDecoder.explicit``)."""
    return (PRECISIONS.index(default),
            *(PRECISIONS.index(layers[v.layers[0]]) for v in space.variables))


def test_every_plan_round_trips_params_key_rules_and_runs_the_same_plan() -> None:
    net, cost, space, _ = _setup(n=3)
    dec = TrialDecoder(space, cost)
    keys = [tuple(int(c) for c in k) for k in enumerate_keys(space)]
    assert len(keys) == 4 ** 4  # the region and 3 layers, fp32/tf32/bf16/fp16 each
    shorter = 0
    for key in keys:
        params = dec.params(key)
        assert dec.key(params) == key and dec.params(dec.key(params)) == params
        explicit = dec.explicit(key)
        assert _key_of_rules(space, *explicit) == key
        default, rules = dec.compact(key)
        shorter += len(rules) < len(explicit[1])
        # the same plan: one schedule for the explicit and the compact rules
        rs = cost.rules(sorted({*explicit[1], *rules}))
        rows = np.stack([rs.codes_of(*explicit), rs.codes_of(default, rules)])
        sch = replay(cost.trace, *rs.encode(rows), cost.device_type, cost.form)
        assert bool(same_as(sch, 0)[1]), (key, explicit, (default, rules))
        # and every GEMM layer computes in the precision the key gives it
        want = {lay: PRECISIONS[c] for v, c in zip(space.variables, key[1:], strict=True)
                for lay in v.layers}
        assert assignment(Policy(default=default, layers=rules), net, space.layers) == want
        # the policy the search applies is the explicit one
        pol = dec.policy(key, target="h100", form="deploy")
        assert (pol.default, pol.layers, pol.form) == (*explicit, "deploy")
    assert shorter > len(keys) // 2  # compaction does write fewer rules


def test_a_trial_decodes_to_its_recorded_rules_else_compact_else_explicit() -> None:
    _, cost, space, _ = _setup(n=3)
    key = space.uniform("bf16")
    ev = PlanScore(0.001, 1.0, 2.0, True)
    bare = Candidate(number=3, params=space.params(key), calib=ev)
    recorded = Candidate(number=4, params=space.params(key), calib=ev,
                         policy={"default": "bf16", "layers": {"fcs.0": "bf16"}})
    with_cost, without = TrialDecoder(space, cost), TrialDecoder(space)  # export: no model
    assert with_cost.rules(recorded) == without.rules(recorded) == ("bf16", {"fcs.0": "bf16"})
    assert with_cost.rules(bare) == with_cost.compact(key) == ("bf16", {})
    assert without.rules(bare) == space.rules(key)  # the same plan, written longer


def test_the_same_plan_as_rules_ignores_the_form_only_without_16_bit_tensors() -> None:
    assert plan_id("fp32", {}, "train") == plan_id("fp32", {}, "deploy")
    assert plan_id("tf32", {}, "train") == plan_id("tf32", {}, "deploy")
    assert plan_id("bf16", {}, "train") != plan_id("bf16", {}, "deploy")
    assert plan_id("fp32", {"a": "bf16", "b": "fp16"}, "deploy") == \
        plan_id("fp32", {"b": "fp16", "a": "bf16"}, "deploy")
