"""Pick the policy from a finished study.

The candidates are a study's completed trials (``study.driver.completed``). The search
scores on the calibration data; the budget binds on the eval data: a trial is
feasible only once it was also within budget there (study/objective.py confirms at once). The
chosen plan is the fastest feasible one. When none is, the run is infeasible and the
closest plan is reported (optuna#4180: pick by a stated rule, say when nothing is
feasible, exit non-zero).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autoprec.evaluation.decision import by_estimate, closeness
from autoprec.search.plan_score import PlanScore


@dataclass
class Candidate:
    number: int
    params: dict[str, str]
    calib: PlanScore
    policy: dict[str, Any] = field(default_factory=dict)  # compact {default, layers}

    @property
    def eval_error(self) -> float | None:
        return self.calib.eval_error


def dedupe(cands: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per distinct plan (the earliest trial): per trial key, spelt as its
    params (``search.decode``: the same name)."""
    seen: dict[tuple[tuple[str, str], ...], Candidate] = {}
    for c in sorted(cands, key=lambda c: c.number):
        seen.setdefault(tuple(sorted(c.params.items())), c)
    return list(seen.values())


def front_positions(errors: Sequence[float], speedups: Sequence[float]) -> list[int]:
    """Positions of the non-dominated points (lower error, higher speed-up), by error.

    A point is on the front when no other point has an error at most as large and a
    strictly larger speed-up (or an equal speed-up and a strictly smaller error).
    """
    order = sorted(range(len(errors)), key=lambda i: (errors[i], -speedups[i]))
    front: list[int] = []
    best = -math.inf
    for i in order:
        if speedups[i] > best:
            front.append(i)
            best = speedups[i]
    return front


def pareto_front(cands: Sequence[Candidate]) -> list[Candidate]:
    """Non-dominated candidates on (error, est_time), fastest first."""
    pts = dedupe(cands)
    pos = front_positions([c.calib.error for c in pts], [-c.calib.est_time for c in pts])
    return [pts[i] for i in reversed(pos)]


def choose(cands: Sequence[Candidate], *, budget: float, min_speedup: float | None
           ) -> tuple[Candidate, bool]:
    """The decision's rule 1 (``evaluation.decision.by_estimate``) on a study's candidates,
    one per distinct plan: the fastest feasible one; else (the closest one, False)."""
    return by_estimate(dedupe(cands), budget=budget, min_speedup=min_speedup)


__all__ = ["Candidate", "choose", "closeness", "dedupe", "front_positions", "pareto_front"]
