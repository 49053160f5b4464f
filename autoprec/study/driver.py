"""The Optuna loop: ``study.optimize`` with the planner's sampler, one trial per plan.

Every measured plan is a COMPLETE trial with its error, estimated time and speed-up in
user attributes; a proposal that is not measured (another trial already measured it, or
the search is complete) is a PRUNED trial with the reason in ``user_attrs["skipped"]``,
never a trial with made-up numbers. ``optimize`` (rather than a hand-written ask/tell
loop) keeps Optuna's heartbeats for PostgreSQL studies: a killed worker's RUNNING trial
is failed and retried by the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import optuna

from autoprec.errors import InputError
from autoprec.search.plan_score import PlanScore
from autoprec.search.select import Candidate
from autoprec.search.space import Key, SearchSpace
from autoprec.study.objective import PlanScorer
from autoprec.study.sampler import PlanSampler

optuna.logging.set_verbosity(optuna.logging.WARNING)

#: How long a trial waits for a higher-numbered trial proposing the same plan to decide.
CLAIM_WAIT_S = 60.0


@dataclass
class TrialResult:
    number: int
    key: Key
    params: dict[str, str]
    evaluation: PlanScore | None  # None: pruned (not measured)
    skipped: str | None = None


class Driver:
    """Runs trials on ``study`` until the sampler ends it (search complete, patience, bad
    input, Ctrl-C: ``PlanSampler``) or the trial count or time runs out. ``on_trial`` is
    called after every trial (progress bar, tracking)."""

    def __init__(self, study: optuna.Study, space: SearchSpace, scorer: PlanScorer,
                 sampler: PlanSampler, *, pareto: bool, trials: int,
                 timeout: float | None = None,
                 on_trial: Callable[[TrialResult], None] | None = None,
                 compact: Callable[[Key], tuple[str, dict[str, str]]] | None = None) -> None:
        self.study, self.space, self.scorer, self.sampler = study, space, scorer, sampler
        self.pareto, self.trials, self.timeout = pareto, trials, timeout
        self.on_trial = on_trial
        self.compact = compact  # key -> the policy's (default, rules) for feasible plans
        self.started = time.monotonic()
        self.fatal: InputError | None = None  # a trial's bad-input error: raised after the run
        self.by_key: dict[Key, int] = {}
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if {v.name for v in space.all_variables} <= set(t.params):
                key = space.key(t.params)
                scorer.remember(key, t.user_attrs)
                self.by_key.setdefault(key, t.number)

    @property
    def ran(self) -> int:
        """Trials this process ran (every state)."""
        return self.sampler.ran

    @property
    def complete(self) -> bool:
        """The planner had nothing left to measure."""
        return self.sampler.complete

    def time_left(self) -> float | None:
        if self.timeout is None:
            return None
        return self.timeout - (time.monotonic() - self.started)

    def _objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
        params = {v.name: str(trial.suggest_categorical(v.name, v.choices))
                  for v in self.space.all_variables}
        key = self.space.key(params)
        if self.sampler.complete:  # the proposal found nothing left (it ended the study)
            trial.set_user_attr("skipped", "search complete: no faster plan is predicted "
                                           "within the budget")
            raise optuna.TrialPruned()
        if key in self.scorer.cache and key in self.by_key:
            trial.set_user_attr("skipped", f"already measured in trial {self.by_key[key]}")
            raise optuna.TrialPruned()
        held = claim(self.study, self.space, trial, key)
        if held is not None:  # another worker proposed it a moment earlier
            trial.set_user_attr("skipped", held)
            raise optuna.TrialPruned()
        try:
            ev = self.scorer(key)
        except Exception as err:  # recorded on the trial; Optuna marks it FAIL and goes on
            trial.set_user_attr("fail_reason", f"{type(err).__name__}: {err}"[:500])
            if isinstance(err, InputError) and self.fatal is None:
                # model.py / the policy is at fault: every other trial would fail the same
                # way; the run stops after this one and says why (exit 2)
                self.fatal = err
                self.sampler.end(self.study, "bad input")
            raise
        for k, v in ev.to_attrs().items():
            trial.set_user_attr(k, v)
        if ev.feasible and self.compact is not None:
            default, rules = self.compact(key)
            trial.set_user_attr("policy", {"default": default, "layers": rules})
        self.by_key.setdefault(key, trial.number)
        # finite and never NaN: a non-finite error is 1e30 (flagged by "nonfinite")
        violation = min(ev.error, 1e30) - self.scorer.budget
        if self.scorer.min_speedup is not None:
            violation = max(violation, self.scorer.min_speedup - ev.est_speedup)
        trial.set_constraint("budget", float(violation))
        if self.pareto:
            return min(ev.error, 1e30), min(ev.est_time, 1e30)
        return min(ev.est_time, 1e30)

    def _after(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        if self.on_trial is None:
            return
        key = self.space.key(frozen.params) if frozen.params else ()
        ev = (self.scorer.cache.get(key)
              if frozen.state == optuna.trial.TrialState.COMPLETE else None)
        self.on_trial(TrialResult(frozen.number, key, dict(frozen.params), ev,
                                  frozen.user_attrs.get("skipped")))

    def nothing_measured(self, study_name: str) -> InputError:
        """No trial of the study measured a plan: there is no closest policy to write. Name
        why (every trial failed: the first reason; or none ran), never choose from nothing."""
        failed = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        reasons = [r for t in failed if (r := t.user_attrs.get("fail_reason"))]
        if reasons:
            return InputError(f"no plan could be measured: all {len(failed)} trials failed, "
                              f"the first with {reasons[0]}; no policy written")
        return InputError(f"no plan was measured in study {study_name!r} (trials run: "
                          f"{self.ran}); no policy written")

    def measured_any(self) -> bool:
        """The study holds a measured plan (this run's or an earlier one's)."""
        return any("error" in t.user_attrs for t in self.study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))

    def run(self) -> None:
        """Propose, measure, record until done.

        ``--timeout`` bounds the search, not its first step: a study without a measured plan
        measures one whatever the clock says, so a tiny timeout still writes a policy (the
        planner's first candidate) instead of nothing."""
        if self.ran >= self.trials or self.sampler.finished(self.study):
            return
        left = self.time_left()
        with _quiet_failed_trials():
            if left is not None and left <= 0:
                if not self.measured_any():
                    self.sampler.start(1, 0.0)
                    self.study.optimize(self._objective, n_trials=1, callbacks=[self._after],
                                        catch=(Exception,))
            else:
                n, timeout = self.trials - self.ran, None if left is None else max(left, 0.0)
                self.sampler.start(n, timeout)
                self.study.optimize(self._objective, n_trials=n, timeout=timeout,
                                    callbacks=[self._after], catch=(Exception,))
        if self.fatal is not None:
            raise self.fatal


def claim(study: optuna.Study, space: SearchSpace, trial: optuna.Trial, key: Key, *,
          wait_s: float = CLAIM_WAIT_S) -> str | None:
    """Claim ``key`` for ``trial`` among workers sharing the study (None), or say which
    trial has it. At most one trial measures a plan, by this rule (each trial's params
    are in storage before it reads, so of two trials proposing one plan at least one
    sees the other):

    - another trial with this plan measured it, or claimed it: yield to it;
    - a lower-numbered trial with this plan is running: yield to it (it may be slow to
      decide: the planner runs after a trial is created);
    - a higher-numbered one is running: it may not have seen this trial, so wait for
      its decision (a claim, or it stops); yield if it claims, else go on.

    Waiting goes only towards higher numbers, so it never cycles; a worker that stops
    deciding (killed) is yielded to after ``wait_s``."""
    names = {v.name for v in space.all_variables}
    deadline = time.monotonic() + wait_s
    while True:
        waiting: int | None = None
        for t in study.get_trials(deepcopy=False, states=(
                optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)):
            if (t.number == trial.number or not t.params or not t.params.keys() >= names
                    or space.key(t.params) != key):
                continue
            if "error" in t.user_attrs or t.user_attrs.get("claimed"):
                return f"measured by trial {t.number}"
            if t.state != optuna.trial.TrialState.RUNNING:
                continue
            if t.number < trial.number:
                return f"measured by trial {t.number}"
            waiting = t.number  # higher-numbered, undecided
        if waiting is None:
            trial.set_user_attr("claimed", True)
            return None
        if time.monotonic() > deadline:
            return (f"trial {waiting} proposed the same plan and did not decide within "
                    f"{wait_s:g} s")
        time.sleep(0.05)


class _DropFailedTrialLogs(logging.Filter):
    """Optuna logs every failed trial with its traceback; the reason is on the trial
    (``fail_reason``, tune's error line and trial table), so the console stays one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Trial ") and " failed" in msg)


@contextlib.contextmanager
def _quiet_failed_trials() -> Iterator[None]:
    logger = logging.getLogger("optuna")
    f = _DropFailedTrialLogs()
    handlers = [*logger.handlers, *logging.getLogger("optuna.study.study").handlers]
    logger.addFilter(f)
    for h in handlers:
        h.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)
        for h in handlers:
            h.removeFilter(f)


def completed(study: optuna.Study) -> list[Candidate]:
    """Every measured trial (COMPLETE with a score), earliest first."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        ev = PlanScore.from_attrs(t.user_attrs)
        if ev is not None:
            out.append(Candidate(t.number, dict(t.params), ev,
                                 dict(t.user_attrs.get("policy") or {})))
    return out


def trial_rows(study: optuna.Study) -> list[dict[str, object]]:
    """One row per trial for tables and MLflow: number, state, errors, times, params.

    The policy file's vocabulary: ``calibration_error`` is what the search scored,
    ``error`` the held-out (eval data) error where the trial was confirmed there."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, object] = {"number": t.number, "state": t.state.name}
        ev = PlanScore.from_attrs(t.user_attrs)
        row["calibration_error"] = ev.error if ev else None
        row["error"] = ev.eval_error if ev else None
        for k in ("est_time", "est_speedup", "feasible", "screened", "skipped", "fail_reason"):
            row[k] = t.user_attrs.get(k)
        if ev is not None:
            row["est_time"] = ev.est_time
        for k, v in t.params.items():
            row[f"params_{k}"] = v
        rows.append(row)
    return rows


__all__ = ["Driver", "TrialResult", "claim", "completed", "trial_rows"]
