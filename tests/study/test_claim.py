"""Two workers proposing one plan at the same moment: exactly one measures it.

``driver.claim`` is the rule; these tests replay the interleavings that measured one plan
twice on a shared PostgreSQL study (a trial is created, RUNNING, before its planner has
chosen its params), then race real threads on one storage.
"""

from __future__ import annotations

import threading

import optuna
import pytest
from optuna.trial import TrialState

from autoprec.search.space import SearchSpace, Variable
from autoprec.study.driver import claim

SPACE = SearchSpace([Variable("fc1", ["fc1"], ["fp32", "bf16"]),
                     Variable("fc2", ["fc2"], ["fp32", "bf16"])])
PARAMS = {"default": "fp32", "fc1": "bf16", "fc2": "fp32"}
KEY = SPACE.key(PARAMS)

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _suggest(trial: optuna.Trial, params: dict[str, str]) -> None:
    for v in SPACE.all_variables:
        trial.suggest_categorical(v.name, v.choices)
    assert SPACE.key(trial.params) == SPACE.key(params)


def _study() -> optuna.Study:
    return optuna.create_study(sampler=optuna.samplers.PartialFixedSampler(
        PARAMS, optuna.samplers.RandomSampler(seed=0)))


def test_a_slow_lower_trial_yields_to_a_higher_one_that_claimed() -> None:
    study = _study()
    low = study.ask()  # created first, its planner still running: no params yet
    high = study.ask()
    _suggest(high, PARAMS)
    assert claim(study, SPACE, high, KEY) is None  # sees no one with this plan
    _suggest(low, PARAMS)
    assert claim(study, SPACE, low, KEY) == f"measured by trial {high.number}"


def test_a_higher_trial_yields_to_a_lower_one_running_the_plan() -> None:
    study = _study()
    low, high = study.ask(), study.ask()
    _suggest(low, PARAMS)
    _suggest(high, PARAMS)
    assert claim(study, SPACE, high, KEY) == f"measured by trial {low.number}"
    study.tell(high, state=TrialState.PRUNED)
    assert claim(study, SPACE, low, KEY) is None  # the higher one stood down


def test_an_undecided_higher_trial_is_waited_for_then_yielded_to() -> None:
    study = _study()
    low, high = study.ask(), study.ask()
    _suggest(low, PARAMS)
    _suggest(high, PARAMS)  # and never decides (its worker was killed)
    why = claim(study, SPACE, low, KEY, wait_s=0.2)
    assert why == f"trial {high.number} proposed the same plan and did not decide within 0.2 s"


def test_another_plan_does_not_block() -> None:
    study = _study()
    study.add_trial(optuna.trial.create_trial(
        params={"default": "fp32", "fc1": "fp32", "fc2": "fp32"},
        distributions={v.name: optuna.distributions.CategoricalDistribution(v.choices)
                       for v in SPACE.all_variables},
        value=1.0, user_attrs={"error": 0.0}))
    mine = study.ask()
    _suggest(mine, PARAMS)
    assert claim(study, SPACE, mine, KEY) is None


def test_racing_threads_measure_the_plan_exactly_once() -> None:
    for _ in range(20):
        study = _study()
        start = threading.Barrier(6)
        went: list[int] = []

        def worker(study: optuna.Study = study, start: threading.Barrier = start,
                   went: list[int] = went) -> None:
            trial = study.ask()
            start.wait()
            _suggest(trial, PARAMS)
            if claim(study, SPACE, trial, KEY, wait_s=30) is None:
                went.append(trial.number)
                study.tell(trial, 1.0)
            else:
                study.tell(trial, state=TrialState.PRUNED)

        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(went) == 1, went
