"""The planner as an Optuna sampler: proposals come from what the storage holds, so a
second process (a resumed run, another worker) goes on with the same walk."""

from __future__ import annotations

from pathlib import Path

import optuna

from autoprec.search.planner import Planner
from autoprec.search.sampler import PlanSampler, measured_state
from tests.search.test_planner import _setup


def test_a_second_study_object_continues_the_walk_it_finds_in_storage(tmp_path: Path) -> None:
    _, cost, space, est = _setup(n=3)
    url = f"sqlite:///{tmp_path / 's.db'}"

    def planner() -> Planner:
        return Planner(space, cost, est, budget=0.003, margin=1.0)

    def objective(trial: optuna.Trial) -> float:
        for v in space.all_variables:
            trial.suggest_categorical(v.name, v.choices)
        trial.set_user_attr("error", 0.1)  # every plan over budget: the walk goes on
        trial.set_user_attr("feasible", False)
        return 1.0

    first = optuna.create_study(storage=url, study_name="s", sampler=PlanSampler(space, planner()))
    first.optimize(objective, n_trials=2)
    second = optuna.load_study(storage=url, study_name="s", sampler=PlanSampler(space, planner()))
    second.optimize(objective, n_trials=2)
    keys = [space.key(t.params) for t in second.trials]
    assert len(keys) == len(set(keys)) == 4  # nothing proposed twice across the two
    ref = planner()
    walk, measured = [], {}
    for _ in range(4):  # the walk a single process would have made
        k = ref.next(measured, {})
        walk.append(k)
        measured[k] = 0.1
    assert keys == walk
    got, feasible, busy = measured_state(second, space)
    assert set(got) == set(walk) and not any(feasible.values()) and not busy


def test_when_the_walk_is_done_the_sampler_says_so() -> None:
    _, cost, space, est = _setup(n=3)
    sampler = PlanSampler(space, Planner(space, cost, est, budget=0.003, margin=1.0))
    study = optuna.create_study(sampler=sampler)

    def objective(trial: optuna.Trial) -> float:
        for v in space.all_variables:
            trial.suggest_categorical(v.name, v.choices)
        if sampler.search_complete:
            raise optuna.TrialPruned()
        trial.set_user_attr("error", 0.0)
        trial.set_user_attr("feasible", True)  # the first (fastest admissible) is feasible
        return 1.0

    assert not sampler.nothing_left_to_measure(study)
    study.optimize(objective, n_trials=3)
    states = [t.state for t in study.trials]
    assert states[0] == optuna.trial.TrialState.COMPLETE
    assert all(s == optuna.trial.TrialState.PRUNED for s in states[1:]) and sampler.search_complete
    assert sampler.nothing_left_to_measure(study)  # what the driver asks between trials
