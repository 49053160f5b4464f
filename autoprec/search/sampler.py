"""The planner as an Optuna sampler: proposals come from storage, so they resume and share.

``sample_relative`` reads the study's trials from its storage on every proposal: finished
trials give measured errors (and which plans were within budget), running trials are plans
another worker is measuring now. It then asks the planner (search/planner.py) for the next
plan. A resumed study, or a second worker on the same PostgreSQL study, therefore goes on
with the same walk instead of repeating it; nothing is enqueued, so no worker can take
another's planned trial.

When the planner has nothing left to measure, ``search_complete`` is set; the objective
then records the trial as PRUNED ("search complete") and stops the study.
``nothing_left_to_measure`` asks the same question between trials (the driver's stop rule),
so no caller reaches through to the planner.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from autoprec.search.evaluation import Evaluation
from autoprec.search.planner import Planner
from autoprec.search.space import Key, SearchSpace


def measured_state(study: optuna.Study, space: SearchSpace, exclude: int | None = None
                   ) -> tuple[dict[Key, float], dict[Key, bool], set[Key]]:
    """(key -> measured error, key -> within budget, keys being measured) from storage."""
    measured: dict[Key, float] = {}
    feasible: dict[Key, bool] = {}
    busy: set[Key] = set()
    names = {v.name for v in space.all_variables}
    for t in study.get_trials(deepcopy=False,
                              states=(TrialState.COMPLETE, TrialState.RUNNING)):
        if t.number == exclude or not names <= set(t.params):
            continue
        key = space.key(t.params)
        if t.state == TrialState.RUNNING:
            busy.add(key)
        elif (ev := Evaluation.from_attrs(t.user_attrs)) is not None:
            measured[key] = ev.error
            feasible[key] = ev.feasible or feasible.get(key, False)
    return measured, feasible, busy


class PlanSampler(BaseSampler):
    """Proposes the planner's next plan (``pareto``: the next point of the predicted front)."""

    def __init__(self, space: SearchSpace, planner: Planner, *, pareto: bool = False,
                 front_points: int = 8, seed: int | None = 0) -> None:
        self.space = space
        self.planner = planner
        self.pareto = pareto
        self.front_points = front_points
        #: The last proposal found nothing left to measure (the search is complete).
        self.search_complete = False
        self._rng = random.Random(seed)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return {v.name: CategoricalDistribution(v.choices) for v in self.space.all_variables}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        key = self._next_plan(study, exclude=trial.number)
        self.search_complete = key is None
        if key is None:
            return {}
        return {k: v for k, v in self.space.params(key).items() if k in search_space}

    def nothing_left_to_measure(self, study: optuna.Study, exclude: int | None = None) -> bool:
        """Whether the planner would propose nothing now, given what ``study``'s storage
        holds (measured and running plans, as a proposal reads them)."""
        return self._next_plan(study, exclude) is None

    def _next_plan(self, study: optuna.Study, exclude: int | None) -> Key | None:
        measured, feasible, busy = measured_state(study, self.space, exclude=exclude)
        if self.pareto:
            return self.planner.front(self.front_points, measured, busy)
        return self.planner.next(measured, feasible, busy)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        # Only reached once the search is complete (the trial is then pruned unmeasured).
        choices: Sequence[Any] = getattr(param_distribution, "choices", (None,))
        return self._rng.choice(list(choices))


__all__ = ["PlanSampler", "measured_state"]
