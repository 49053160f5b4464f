"""The Optuna loop: planned trials (seeds, bisection, greedy fill) then the sampler.

Every scored assignment is an Optuna trial, whichever phase proposed it, so a study holds
the whole history: it can be resumed, shared by several workers and exported. Planned
trials are enqueued one at a time (the next depends on the last result); the sampler
(TPE with constraints, or NSGA-II/TPE for a Pareto front) fills the remaining budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optuna

from autoprec.search.evaluation import Evaluation
from autoprec.search.objective import Evaluator
from autoprec.search.space import SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass
class TrialResult:
    number: int
    params: dict[str, str]
    evaluation: Evaluation
    phase: str


class Driver:
    """Runs trials on ``study`` until the trial count or time runs out."""

    def __init__(
        self,
        study: optuna.Study,
        space: SearchSpace,
        evaluator: Evaluator,
        *,
        pareto: bool,
        trials: int,
        timeout: float | None = None,
        patience: int | None = None,
        on_trial: Callable[[TrialResult], None] | None = None,
        skip: Callable[[Mapping[str, str], float], tuple[str, float] | None] | None = None,
    ) -> None:
        self.study, self.space, self.evaluator = study, space, evaluator
        self.pareto, self.trials, self.timeout, self.patience = pareto, trials, timeout, patience
        self.on_trial = on_trial
        # skip(params, best_feasible_time) -> (why, estimated error) for a sampler proposal
        # not worth a model run (slower than the best feasible, or hopeless by the probes).
        self.skip = skip
        self.started = time.monotonic()
        self.ran = 0
        self.best_time = math.inf
        self.since_best = 0
        self.stopped = False
        self.results: list[TrialResult] = []
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if "skipped" not in t.user_attrs:  # a skipped trial's error is an estimate
                evaluator.remember(t.params, t.user_attrs)

    # -- budget ---------------------------------------------------------------------------
    def time_left(self) -> float | None:
        if self.timeout is None:
            return None
        return self.timeout - (time.monotonic() - self.started)

    @property
    def exhausted(self) -> bool:
        left = self.time_left()
        return self.stopped or self.ran >= self.trials or (left is not None and left <= 0)

    # -- the objective --------------------------------------------------------------------
    def _objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
        params = {
            v.name: str(trial.suggest_categorical(v.name, v.choices))
            for v in self.space.variables
        }
        skipped = None
        if self.skip is not None and "phase" not in trial.user_attrs:
            skipped = self.skip(params, self.best_time)
        try:
            if skipped is not None:  # no model run: the estimate stands in, never chosen
                why, estimated = skipped
                t, speedup = self.evaluator.timing(params)
                ev = Evaluation(estimated, t, speedup, False, screened=True, cached=True)
                trial.set_user_attr("skipped", why)
            else:
                ev = self.evaluator(params)
        except Exception as err:  # recorded on the trial; Optuna marks it FAIL and goes on
            trial.set_user_attr("fail_reason", f"{type(err).__name__}: {err}"[:500])
            raise
        for k, v in ev.as_attrs().items():
            trial.set_user_attr(k, v)
        trial.set_user_attr("evaluated", not ev.cached)
        violation = (min(ev.error, 1e30) - self.evaluator.budget)
        if self.evaluator.min_speedup is not None:
            violation = max(violation, self.evaluator.min_speedup - ev.est_speedup)
        # Optuna 5: constraints live on the trial (<= 0 is feasible); TPE and NSGA-II read them
        trial.set_constraint("budget", violation)
        if self.pareto:
            return min(ev.error, 1e30), ev.est_time
        return ev.est_time

    def _after(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        self.ran += 1
        phase = str(frozen.user_attrs.get("phase") or "sampler")
        if frozen.state == optuna.trial.TrialState.COMPLETE:
            ev = Evaluation(
                math.inf if frozen.user_attrs.get("nonfinite") else frozen.user_attrs["error"],
                frozen.user_attrs["est_time"], frozen.user_attrs["est_speedup"],
                frozen.user_attrs["feasible"], frozen.user_attrs.get("screened", False),
                not frozen.user_attrs.get("evaluated", True))
            res = TrialResult(frozen.number, dict(frozen.params), ev, phase)
            self.results.append(res)
            if ev.feasible and ev.est_time < self.best_time * (1 - 1e-9):
                self.best_time = ev.est_time
                self.since_best = 0
            else:
                self.since_best += 1
            if self.on_trial is not None:
                self.on_trial(res)
        else:
            self.since_best += 1
        if self.patience is not None and self.since_best >= self.patience:
            self.stopped = True
            study.stop()
        if self.exhausted:
            study.stop()

    # -- phases ---------------------------------------------------------------------------
    def run_planned(self, params: Mapping[str, str], phase: str) -> Evaluation | None:
        """Enqueue one assignment and run it; None when the budget is spent or it failed."""
        if self.exhausted:
            return None
        self.study.enqueue_trial(dict(params), user_attrs={"phase": phase},
                                 skip_if_exists=False)
        before = len(self.results)
        self.study.optimize(self._objective, n_trials=1, callbacks=[self._after],
                            catch=(Exception,))
        if len(self.results) > before:
            return self.results[-1].evaluation
        return None

    def run_sampler(self) -> None:
        """Let the study's sampler propose trials until the budget is spent."""
        if self.exhausted:
            return
        left = self.time_left()
        self.study.optimize(
            self._objective,
            n_trials=self.trials - self.ran,
            timeout=None if left is None else max(left, 0.0),
            callbacks=[self._after],
            catch=(Exception,),
        )


def make_sampler(pareto: bool, seed: int, n_startup: int = 8) -> optuna.samplers.BaseSampler:
    """TPE with constraints (fastest within budget), or NSGA-II for a Pareto front.

    Both read the constraint each trial sets (``trial.set_constraint``)."""
    if pareto:
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=16)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup, multivariate=True)


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One row per trial for tables and MLflow: number, state, error, times, params."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"number": t.number, "state": t.state.name,
                               "phase": t.user_attrs.get("phase", "sampler")}
        for k in ("error", "est_time", "est_speedup", "feasible", "screened", "skipped",
                  "fail_reason"):
            row[k] = t.user_attrs.get(k)
        if t.user_attrs.get("nonfinite"):
            row["error"] = math.inf
        for k, v in t.params.items():
            row[f"params_{k}"] = v
        rows.append(row)
    return rows
