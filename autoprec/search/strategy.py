"""Informed starting points for the search, ordered by speed gain per unit of sensitivity.

A *move* lowers one variable to one precision. Moves are ranked by
``gain / sensitivity``: the cost model's time saved by that move alone (from all-default),
over the probes' cheap estimate of its end-to-end error. Taking the first ``k`` moves gives
a ladder of assignments from all-fp32 (k = 0) to "everything the probes allow" whose
error grows roughly monotonically with ``k``; bisection on ``k`` finds the largest
feasible prefix in ~log2(moves) real evaluations, and a greedy pass then tries the
remaining moves one at a time. Neural Compressor's basic strategy starts from all-low and
falls back one layer per evaluation; this needs far fewer evaluations when the ranking is
good, and never fewer than that when it is not (the fill pass is the same walk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from autoprec.search.space import SearchSpace


@dataclass(frozen=True)
class Move:
    variable: str
    precision: str
    gain: float  # seconds saved vs all-default (cost model)
    sensitivity: float  # estimated end-to-end error of this move alone

    @property
    def score(self) -> float:
        return self.gain / max(self.sensitivity, 1e-12)


def rank_moves(
    space: SearchSpace,
    time_of: Callable[[Mapping[str, str]], float],
    sensitivity_of: Callable[[str, str], float],
) -> list[Move]:
    """All moves that save time, best ``gain / sensitivity`` first.

    ``time_of(params)`` is the estimated time of an Optuna params dict;
    ``sensitivity_of(layer, precision)`` the probes' cheap estimate for one layer.
    """
    base_params = {v.name: space.default for v in space.variables}
    base = time_of(base_params)
    moves = []
    for v in space.variables:
        for p in v.choices:
            if p == space.default:
                continue
            t = time_of({**base_params, v.name: p})
            gain = base - t
            if gain <= 0:
                continue  # e.g. fp8 on a small GEMM: the scaling passes cost more
            # errors of independent layers add roughly in quadrature
            sens = math.sqrt(sum(sensitivity_of(lay, p) ** 2 for lay in v.layers))
            moves.append(Move(v.name, p, gain, sens))
    moves.sort(key=lambda m: (-m.score, m.variable, m.precision))
    return moves


def prefix_params(space: SearchSpace, moves: list[Move], k: int) -> dict[str, str]:
    """Params after the first ``k`` moves; a later move of a variable wins only if it
    saves more time than the one already taken."""
    params = {v.name: space.default for v in space.variables}
    taken: dict[str, float] = {}
    for m in moves[:k]:
        if m.gain > taken.get(m.variable, 0.0):
            params[m.variable] = m.precision
            taken[m.variable] = m.gain
    return params


def bisect_prefix(n_moves: int, feasible: Callable[[int], bool | None]) -> int:
    """Largest ``k`` in [0, n_moves] with ``feasible(k)``, assuming feasibility is
    monotone (k = 0 is feasible: nothing lowered). ``feasible`` returning None stops early
    (trial budget spent) with the best ``k`` known so far."""
    lo, hi = 0, n_moves  # invariant: lo feasible, everything > hi infeasible
    if n_moves == 0:
        return 0
    first = feasible(n_moves)  # everything lowered: often fine for a robust model
    if first is None:
        return 0
    if first:
        return n_moves
    hi = n_moves - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = feasible(mid)
        if ok is None:
            break
        if ok:
            lo = mid
        else:
            hi = mid - 1
    return lo
