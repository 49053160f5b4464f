"""Pick the policy from a finished study, and confirm it on held-out data.

The search scores on the calibration data; the budget binds on the eval data. Candidates
are tried fastest-first: the first whose eval-data error is within budget wins. When none
is, the run is infeasible and the closest candidate is reported (optuna#4180: pick by a
stated rule, say when nothing is feasible, exit non-zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import optuna

from autoprec.search.evaluation import Evaluation

#: How many calibration-feasible candidates are confirmed on eval data before giving up.
MAX_CONFIRM = 5


@dataclass
class Candidate:
    number: int
    params: dict[str, str]
    calib: Evaluation
    eval_error: float | None = None  # error on the eval data (None: same as calibration)


def _evaluation(t: optuna.trial.FrozenTrial) -> Evaluation:
    a = t.user_attrs
    err = math.inf if a.get("nonfinite") else float(a["error"])
    return Evaluation(err, float(a["est_time"]), float(a["est_speedup"]), bool(a["feasible"]),
                      bool(a.get("screened", False)))


def completed(study: optuna.Study) -> list[Candidate]:
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if "est_time" in t.user_attrs:
            out.append(Candidate(t.number, dict(t.params), _evaluation(t)))
    return out


def dedupe(cands: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per distinct assignment (the earliest trial)."""
    seen: dict[tuple[tuple[str, str], ...], Candidate] = {}
    for c in sorted(cands, key=lambda c: c.number):
        seen.setdefault(tuple(sorted(c.params.items())), c)
    return list(seen.values())


def pareto_front(cands: Sequence[Candidate]) -> list[Candidate]:
    """Non-dominated candidates on (error, est_time), fastest first."""
    pts = sorted(dedupe(cands), key=lambda c: (c.calib.est_time, c.calib.error))
    front: list[Candidate] = []
    best_err = math.inf
    for c in pts:
        if c.calib.error < best_err:
            front.append(c)
            best_err = c.calib.error
    return front


def closeness(ev: Evaluation, budget: float, min_speedup: float | None) -> float:
    """How far from feasible (0 = feasible): relative budget overshoot + speed shortfall."""
    over = 0.0 if ev.error <= budget else (ev.error - budget) / max(budget, 1e-12)
    if not math.isfinite(over):
        over = 1e30
    short = 0.0
    if min_speedup is not None and ev.est_speedup < min_speedup:
        short = (min_speedup - ev.est_speedup) / min_speedup
    return over + short


def choose(
    cands: Sequence[Candidate],
    *,
    budget: float,
    min_speedup: float | None,
    confirm: Callable[[Mapping[str, str]], float] | None,
) -> tuple[Candidate, bool]:
    """The fastest candidate feasible on calibration data whose eval error is within
    budget; else (closest candidate, False). ``confirm(params)`` returns the eval-data error
    (None: the eval data is the calibration data)."""
    cands = dedupe(cands)
    feasible = sorted((c for c in cands if c.calib.feasible),
                      key=lambda c: (c.calib.est_time, c.calib.error, c.number))
    for c in feasible[:MAX_CONFIRM]:
        if confirm is None:
            return c, True
        c.eval_error = confirm(c.params)
        if c.eval_error <= budget:
            return c, True
    if not cands:
        raise ValueError("no completed trials to choose from")
    closest = min(cands, key=lambda c: (closeness(c.calib, budget, min_speedup),
                                        c.calib.est_time, c.number))
    if confirm is not None and closest.eval_error is None:
        closest.eval_error = confirm(closest.params)
    return closest, False
