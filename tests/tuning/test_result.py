"""TuneResult by concern (``autoprec.tuning.result``): the plan, the search, the run's
costs, the short training runs and the report files; the README's attributes on it."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

import autoprec
from autoprec.policy import Policy
from autoprec.tuning.result import (
    CONCERNS,
    FLAT_NAMES,
    RunCosts,
    SearchRecord,
    TrainCheckRuns,
    TuneResult,
    WrittenPlan,
)

#: Every attribute of the flat TuneResult before it was held by concern.
FORMER = (
    "policy", "path", "feasible", "error", "eval_error", "est_speedup", "budget", "study_name",
    "storage", "trials", "evaluations", "seconds", "front", "front_paths", "trials_table",
    "sensitivity", "graph", "notes", "complete", "method", "speed", "report", "priced",
    "measured", "plot_plans", "reference", "weight_bytes", "peak_memory", "peak_memory_how",
    "memory_stages", "stage_seconds", "stage_cpu_seconds", "train_checks", "train_table",
    "train_seconds", "train_cpu_seconds")
#: The attributes README's Python API reads (and api.tune's docstring names) on the result.
PUBLIC = ("policy", "path", "feasible", "error", "est_speedup")


def _result() -> TuneResult:
    return TuneResult(
        plan=WrittenPlan(policy=Policy(default="bf16"), path=Path("p.yaml"), feasible=True,
                         error=0.004, eval_error=0.005, est_speedup=1.7, budget=0.01),
        search=SearchRecord(study_name="s", storage="memory", trials=3, evaluations=2.5))


def test_the_readme_attributes_are_on_the_result() -> None:
    res = _result()
    assert autoprec.TuneResult is TuneResult
    assert (res.policy, res.path, res.feasible, res.error, res.est_speedup) == (
        res.plan.policy, Path("p.yaml"), True, 0.004, 1.7)
    for name in PUBLIC:  # read-only: the plan holds them
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(res, name, None)


def test_every_former_attribute_has_one_place() -> None:
    assert len(FORMER) == 36
    assert set(FLAT_NAMES) | set(PUBLIC) | {"report"} == set(FORMER)
    placed = [*FLAT_NAMES.values(), *(f"plan.{p}" for p in PUBLIC)]
    assert sorted(placed) == sorted(f"{c}.{f.name}" for c, cls in CONCERNS.items()
                                    for f in dataclasses.fields(cls))
    res = _result()
    for name, where in FLAT_NAMES.items():
        concern, field = where.split(".")
        getattr(getattr(res, concern), field)  # each is there
        with pytest.raises(AttributeError, match=f"TuneResult.{name} is TuneResult.{where}"):
            getattr(res, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        res.nothing  # noqa: B018
    assert pickle.loads(pickle.dumps(res)) == res  # the hint leaves copying alone


def test_the_concerns_are_frozen_and_default_empty() -> None:
    res = _result()
    assert res.costs == RunCosts() and res.train_check == TrainCheckRuns() and res.report == []
    for part in (res, res.plan, res.search, res.costs, res.train_check):
        assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.search.trials = 4  # type: ignore[misc]
    later = dataclasses.replace(res, costs=dataclasses.replace(res.costs, peak_memory=5))
    assert later.costs.peak_memory == 5 and later.plan is res.plan
