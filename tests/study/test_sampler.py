"""The planner as an Optuna sampler: proposals come from what the storage holds, so a
second process (a resumed run, another worker) goes on with the same walk."""

from __future__ import annotations

from pathlib import Path

import optuna

from autoprec.search.planner import Planner
from autoprec.study.sampler import PlanSampler, measured_state
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


def _objective(space, error: float, feasible: bool):
    def objective(trial: optuna.Trial) -> float:
        for v in space.all_variables:
            trial.suggest_categorical(v.name, v.choices)
        trial.set_user_attr("error", error)
        trial.set_user_attr("feasible", feasible)
        trial.set_user_attr("est_time", 1.0)
        return 1.0

    return objective


def test_when_the_walk_is_done_the_sampler_ends_the_study_itself() -> None:
    """Like Optuna's GridSampler: no driver, no callback — ``study.optimize`` returns after
    the trial that leaves the planner nothing to measure, not after n_trials."""
    _, cost, space, est = _setup(n=3)
    sampler = PlanSampler(space, Planner(space, cost, est, budget=0.003, margin=1.0))
    study = optuna.create_study(sampler=sampler)
    assert not sampler.finished(study)
    # the first (fastest admissible) plan is feasible: nothing faster is left
    study.optimize(_objective(space, 0.0, True), n_trials=10)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE]
    assert sampler.complete and sampler.stop_reason is None and sampler.ran == 1
    assert sampler.finished(study)  # what the driver asks before a run
    again = PlanSampler(space, Planner(space, cost, est, budget=0.003, margin=1.0))
    assert again.finished(optuna.load_study(study_name=study.study_name,
                                            storage=study._storage, sampler=again))


def test_a_walk_over_budget_everywhere_ends_by_itself_when_the_planner_runs_out() -> None:
    """Every plan over budget: the walk goes on until no plan is predicted within budget,
    then the study ends (at most one proposal that found nothing, pruned unmeasured)."""
    _, cost, space, est = _setup(n=2)
    sampler = PlanSampler(space, Planner(space, cost, est, budget=0.003, margin=1.0))
    study = optuna.create_study(sampler=sampler)
    obj = _objective(space, 0.1, False)

    def objective(trial: optuna.Trial) -> float:
        value = obj(trial)
        if sampler.complete:
            raise optuna.TrialPruned()
        return value

    study.optimize(objective, n_trials=10_000)
    states = [t.state for t in study.trials]
    assert sampler.complete and len(states) < 10_000
    assert states[-1] in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    assert states.count(optuna.trial.TrialState.PRUNED) <= 1


def test_patience_ends_the_study_after_k_trials_without_a_faster_plan() -> None:
    _, cost, space, est = _setup(n=3)
    k = 3
    sampler = PlanSampler(space, Planner(space, cost, est, budget=0.003, margin=1.0),
                          patience=k)
    study = optuna.create_study(sampler=sampler)
    study.optimize(_objective(space, 0.1, False), n_trials=50)  # nothing ever within budget
    assert len(study.trials) == k and sampler.ran == k
    assert sampler.stop_reason is not None and "patience" in sampler.stop_reason
    assert not sampler.complete and sampler.finished(study)


def test_the_trial_count_ends_the_study_without_asking_the_planner_once_more() -> None:
    _, cost, space, est = _setup(n=3)
    sampler = PlanSampler(space, Planner(space, cost, est, budget=0.003, margin=1.0))
    study = optuna.create_study(sampler=sampler)
    sampler.start(1, None)
    study.optimize(_objective(space, 0.0, True), n_trials=1)
    assert not sampler.complete  # the run's trials were used up first: not "complete"
    assert sampler.finished(study) and sampler.complete  # asked, it is
