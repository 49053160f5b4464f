"""The planner as an Optuna sampler: proposals come from storage, so they resume and share.

``sample_relative`` reads the study's trials from its storage on every proposal: finished
trials give measured errors (and which plans were within budget), running trials are plans
another worker is measuring now. It then asks the planner (search/planner.py) for the next
plan. A resumed study, or a second worker on the same PostgreSQL study, therefore goes on
with the same walk instead of repeating it; nothing is enqueued, so no worker can take
another's planned trial.

The sampler also ends the study itself, as Optuna's GridSampler and BruteForceSampler
do (``study.stop()`` from ``after_trial``), for every reason a search ends before
``study.optimize``'s own trial count and timeout: the planner has nothing left to measure
(``complete``; a proposal that finds nothing sets it too, and the objective then records
that trial as PRUNED, "search complete"), ``patience`` trials without a faster plan
within budget, or ``end(study, reason)`` from outside (a trial's bad input, Ctrl-C).
``finished(study)`` answers the same question before a run starts, so no caller reaches
through to the planner.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from autoprec.search.plan_score import PlanScore
from autoprec.search.planner import Planner
from autoprec.search.space import Key, SearchSpace


def measured_state(study: optuna.Study, space: SearchSpace, exclude: int | None = None,
                   finishing: tuple[FrozenTrial, TrialState] | None = None
                   ) -> tuple[dict[Key, float], dict[Key, bool], set[Key]]:
    """(key -> measured error, key -> within budget, keys being measured) from storage.

    ``finishing``: a trial being told (``after_trial``: still RUNNING in storage) and the
    state it ends in."""
    measured: dict[Key, float] = {}
    feasible: dict[Key, bool] = {}
    busy: set[Key] = set()
    names = {v.name for v in space.all_variables}
    done = finishing[0].number if finishing is not None else None
    for t in study.get_trials(deepcopy=False,
                              states=(TrialState.COMPLETE, TrialState.RUNNING)):
        if t.number == exclude or not names <= set(t.params):
            continue
        state = t.state
        if t.number == done:
            t, state = finishing  # type: ignore[misc]
            if state != TrialState.COMPLETE:
                continue
        key = space.key(t.params)
        if state == TrialState.RUNNING:
            busy.add(key)
        elif (ev := PlanScore.from_attrs(t.user_attrs)) is not None:
            measured[key] = ev.error
            feasible[key] = ev.feasible or feasible.get(key, False)
    return measured, feasible, busy


class PlanSampler(BaseSampler):
    """Proposes the planner's next plan (``pareto``: the next point of the predicted front)
    and ends the study when the search is over (module docstring)."""

    def __init__(self, space: SearchSpace, planner: Planner, *, pareto: bool = False,
                 front_points: int = 8, seed: int | None = 0,
                 patience: int | None = None) -> None:
        self.space = space
        self.planner = planner
        self.pareto = pareto
        self.front_points = front_points
        #: End the study after this many finished trials of this process without a faster
        #: plan within budget (None: never); a pruned trial (not measured) does not count.
        self.patience = patience
        #: The planner has nothing left to measure (the search is complete).
        self.complete = False
        #: Why the study was ended before it was complete (None: it was not).
        self.stop_reason: str | None = None
        self.ran = 0  # trials of this process told so far (every state)
        self._trials: int | None = None  # this run's trial count (``start``)
        self._deadline: float | None = None  # and its end (time.monotonic)
        self._best_time = math.inf
        self._since_best = 0
        self._rng = random.Random(seed)

    def start(self, trials: int, timeout: float | None) -> None:
        """The run's own limits (``study.optimize``'s n_trials and timeout): once they are
        reached the study ends anyway, and the planner is not asked once more."""
        self._trials = self.ran + trials
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return {v.name: CategoricalDistribution(v.choices) for v in self.space.all_variables}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        key = self._next_plan(study, exclude=trial.number)
        if key is None:
            self._complete(study)
            return {}
        return {k: v for k, v in self.space.params(key).items() if k in search_space}

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        """Count the trial towards ``patience``; end the study when the search is over."""
        self.ran += 1
        if state == TrialState.COMPLETE:
            ev = PlanScore.from_attrs(trial.user_attrs)
            if ev is not None and ev.feasible and ev.est_time < self._best_time * (1 - 1e-9):
                self._best_time = ev.est_time
                self._since_best = 0
            else:
                self._since_best += 1
        elif state != TrialState.PRUNED:
            self._since_best += 1
        if self.patience is not None and self._since_best >= self.patience:
            self.end(study, f"patience: {self.patience} trials without a faster plan "
                            "within budget")
        if (not self.complete and self.stop_reason is None and not self._limits_reached()
                and self._next_plan(study, exclude=None, finishing=(trial, state)) is None):
            self._complete(study)

    def end(self, study: optuna.Study, reason: str) -> None:
        """End the study after the running trial, saying why."""
        if self.stop_reason is None:
            self.stop_reason = reason
        _stop(study)

    def finished(self, study: optuna.Study) -> bool:
        """Whether a run would measure nothing now: the study was ended, or the planner
        proposes nothing given what ``study``'s storage holds (then ``complete``)."""
        if self.stop_reason is not None or self.complete:
            return True
        if self._next_plan(study, exclude=None) is None:
            self.complete = True
        return self.complete

    def _complete(self, study: optuna.Study) -> None:
        self.complete = True
        _stop(study)

    def _limits_reached(self) -> bool:
        if self._trials is not None and self.ran >= self._trials:
            return True
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _next_plan(self, study: optuna.Study, exclude: int | None,
                   finishing: tuple[FrozenTrial, TrialState] | None = None) -> Key | None:
        measured, feasible, busy = measured_state(study, self.space, exclude=exclude,
                                                  finishing=finishing)
        if self.pareto:
            return self.planner.front(self.front_points, measured, busy)
        return self.planner.next(measured, feasible, busy)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        # Only reached once the search is complete (the trial is then pruned unmeasured).
        choices: Sequence[Any] = getattr(param_distribution, "choices", (None,))
        return self._rng.choice(list(choices))


def _stop(study: optuna.Study) -> None:
    # outside study.optimize (ask/tell, between runs) there is no loop to leave: Optuna
    # raises RuntimeError; ``finished`` keeps the next run from starting
    with contextlib.suppress(RuntimeError):
        study.stop()


__all__ = ["PlanSampler", "measured_state"]
