"""The best-first walk: fastest first, probe-pruned, stops at the first feasible."""

from __future__ import annotations

import itertools

import numpy as np

from autoprec.precisions import PRECISIONS
from autoprec.search import walk
from autoprec.search.evaluation import Evaluation
from autoprec.search.space import build_space

SPEED = {"fp32": 4.0, "tf32": 2.0, "bf16": 1.0, "fp16": 1.0, "fp8": 0.5}


class ToyTimer(walk.SpaceTimer):
    """Additive per-layer times instead of a cost model (same interface)."""

    def __init__(self, space, weight):  # noqa: D107 - test helper
        self.space, self.weight = space, weight

    def times(self, keys):
        return np.array([sum(self.weight[i] * SPEED[PRECISIONS[c]] for i, c in enumerate(k))
                         for k in keys])


def _space():
    layers = ["a", "b", "c"]
    allowed = {lay: ["fp32", "tf32", "bf16", "fp16", "fp8"] for lay in layers}
    return build_space(layers, allowed, {}, PRECISIONS)


def test_fastest_is_the_exact_minimum_of_an_additive_cost():
    sp = _space()
    timer = ToyTimer(sp, [1.0, 2.0, 3.0])
    assert timer.params(walk.fastest(sp, timer)) == {"a": "fp8", "b": "fp8", "c": "fp8"}


def test_walk_returns_the_fastest_feasible_and_evaluates_only_admitted_keys():
    sp = _space()
    timer = ToyTimer(sp, [1.0, 2.0, 3.0])
    # error of a layer at a precision; feasible when the quadrature sum <= 0.01
    err = {"fp32": 0.0, "tf32": 0.001, "bf16": 0.004, "fp16": 0.002, "fp8": 0.03}
    truth = {lay: dict(err) for lay in "abc"}
    truth["c"]["fp16"] = 0.02  # c breaks in fp16 although the probes think it does not
    predicted = walk.predictor(sp, lambda lay, p: err[p])
    evaluated = []

    def evaluate(params):
        evaluated.append(dict(params))
        e = sum(truth[lay][p] ** 2 for lay, p in params.items()) ** 0.5
        return Evaluation(e, 0.0, 1.0, e <= 0.01)

    got = walk.best_first(sp, timer, predicted, evaluate, limit=1.25 * 0.01)
    # the exhaustive answer over all 125 assignments
    feasible = [dict(zip("abc", ps)) for ps in itertools.product(PRECISIONS, repeat=3)
                if sum(truth[lay][p] ** 2 for lay, p in zip("abc", ps)) ** 0.5 <= 0.01]
    best = min(feasible, key=lambda a: timer.times([timer.key(a)])[0])
    assert timer.times([timer.key(got)])[0] == timer.times([timer.key(best)])[0]
    # nothing the probes put over 1.25x the budget was run (fp8 anywhere: 0.03 > 0.0125)
    assert all("fp8" not in e.values() for e in evaluated)
    assert len(evaluated) <= 4  # far fewer than the 125 assignments


def test_walk_stops_when_the_trial_budget_is_spent():
    sp = _space()
    timer = ToyTimer(sp, [1.0, 1.0, 1.0])
    calls = []

    def evaluate(params):
        calls.append(params)
        return None if len(calls) == 2 else Evaluation(1.0, 0.0, 1.0, False)

    assert walk.best_first(sp, timer, lambda k: 0.0, evaluate, limit=1.0) is None
    assert len(calls) == 2


def test_equally_fast_assignments_try_the_more_accurate_first():
    sp = build_space(["a"], {"a": ["fp32", "bf16", "fp16"]}, {}, ["fp32", "bf16", "fp16"])
    timer = ToyTimer(sp, [1.0])
    seen = []

    def evaluate(params):
        seen.append(params["a"])
        return Evaluation(0.0, 0.0, 1.0, True)

    est = {"bf16": 0.004, "fp16": 0.0005}
    walk.best_first(sp, timer, walk.predictor(sp, lambda lay, p: est[p]), evaluate, limit=1.0)
    assert seen == ["fp16"]
