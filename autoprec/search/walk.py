"""Best-first walk over assignments, fastest first, pruned by the probes.

The planned phase of a single-objective tune. The cost model is cheap and exact about
what it models; the model is expensive. So assignments are visited in order of estimated
time (a priority queue seeded with the fastest assignment and the uniform ones; each
visited assignment pushes its one-variable changes), and the model runs only on those
whose probe-predicted error (per-layer estimates added in quadrature) is within
``margin`` x the budget. The first assignment within budget is the fastest the probes
admit: on a small space that is the exhaustive optimum whenever the probes never reject a
feasible assignment (experiments/tune_baselines.py measures it). The sampler phase that
follows explores what the probes pruned.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from autoprec.cost import CostModel
from autoprec.precisions import PRECISIONS
from autoprec.search.evaluation import Evaluation
from autoprec.search.space import SearchSpace

Key = tuple[int, ...]  # one precision code (index into PRECISIONS) per variable


class SpaceTimer:
    """Vectorised cost-model time of many assignments of ``space`` at once."""

    def __init__(self, space: SearchSpace, cost: CostModel) -> None:
        self.space = space
        self.cost = cost
        self.base = cost.encode(space.locked)  # (n_layers,) codes; locked at default
        self.slots: list[np.ndarray] = []
        for v in space.variables:
            idx = [cost.layer_index(lay) for lay in v.layers]
            self.slots.append(np.array([i for i in idx if i is not None], dtype=np.intp))

    def codes(self, keys: Sequence[Key]) -> np.ndarray:
        out = np.tile(self.base, (len(keys), 1))  # (K, n_layers)
        for row, key in enumerate(keys):
            for slot, code in zip(self.slots, key):
                out[row, slot] = code
        return out

    def times(self, keys: Sequence[Key]) -> np.ndarray:
        return np.atleast_1d(self.cost.estimate_codes(self.codes(keys)))

    def key(self, params: Mapping[str, str]) -> Key:
        return tuple(PRECISIONS.index(params.get(v.name, self.space.default))
                     for v in self.space.variables)

    def params(self, key: Key) -> dict[str, str]:
        return {v.name: PRECISIONS[c] for v, c in zip(self.space.variables, key)}


def fastest(space: SearchSpace, timer: SpaceTimer, passes: int = 3) -> Key:
    """The fastest assignment by coordinate descent from the fastest uniform one (fp8 on
    large GEMMs beside bf16 elsewhere: a mix no uniform seed holds)."""
    starts = [timer.key(space.uniform(p)) for p in PRECISIONS]
    best = starts[int(np.argmin(timer.times(starts)))]
    for _ in range(passes):
        changed = False
        for i, v in enumerate(space.variables):
            cands = [best[:i] + (PRECISIONS.index(c),) + best[i + 1:] for c in v.choices]
            t = timer.times(cands)
            j = int(np.argmin(t))
            if cands[j] != best and t[j] < timer.times([best])[0] * (1 - 1e-9):
                best, changed = cands[j], True
        if not changed:
            break
    return best


def best_first(
    space: SearchSpace,
    timer: SpaceTimer,
    predicted: Callable[[Key], float],
    evaluate: Callable[[dict[str, str]], Evaluation | None],
    *,
    limit: float,
    confirm: Callable[[dict[str, str]], bool] | None = None,
    max_visits: int = 1000,
) -> dict[str, str] | None:
    """Walk fastest-first; return the first params that are feasible (and confirmed), or
    None when the trial budget, the visits or the space ran out first.

    ``predicted(key)``: the probes' error estimate; only keys with ``predicted <= limit``
    are evaluated. ``evaluate`` returns None when the trial budget is spent.
    """
    # (time, predicted error, order, key): among equally fast assignments (bf16 and fp16
    # cost the same) the one the probes call more accurate is tried first.
    heap: list[tuple[float, float, int, Key]] = []
    seen: set[Key] = set()

    def push(keys: list[Key]) -> None:
        keys = [k for k in keys if k not in seen]
        if not keys:
            return
        for k, t in zip(keys, timer.times(keys)):
            seen.add(k)
            if math.isfinite(float(t)):
                heapq.heappush(heap, (float(t), predicted(k), len(seen), k))

    push([fastest(space, timer)] + [timer.key(space.uniform(p)) for p in PRECISIONS])
    visits = 0
    while heap and visits < max_visits:
        _, guess, _, key = heapq.heappop(heap)
        visits += 1
        if guess <= limit:
            params = timer.params(key)
            ev = evaluate(params)
            if ev is None:
                return None
            if ev.feasible and (confirm is None or confirm(params)):
                return params
        children = []
        for i, v in enumerate(space.variables):
            for c in v.choices:
                code = PRECISIONS.index(c)
                if code != key[i]:
                    children.append(key[:i] + (code,) + key[i + 1:])
        push(children)
    return None


def predictor(space: SearchSpace, estimate: Callable[[str, str], float]
              ) -> Callable[[Key], float]:
    """Quadrature sum of the probes' per-layer estimates for a key (fast: a table)."""
    sq = []
    for v in space.variables:
        row = [0.0] * len(PRECISIONS)
        for c in v.choices:
            if c != space.default:
                row[PRECISIONS.index(c)] = sum(estimate(lay, c) ** 2 for lay in v.layers)
        sq.append(row)

    def predicted(key: Key) -> float:
        return math.sqrt(sum(sq[i][c] for i, c in enumerate(key)))

    return predicted
