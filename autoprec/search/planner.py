"""The cheap part of the search, solved: every plan's time exactly, its error predicted.

A plan's time comes from the cost model's replay of the recorded forward (exact for what
it models, casts at every boundary included: the cost is not separable by layer). Its
error is predicted from the probes: each layer's end-to-end estimate, added in quadrature
(independent rounding errors add in squares). The model is expensive; the cost model and
the prediction are cheap (tens of microseconds per plan, vectorised). So:

1. **Candidates.** When the space has at most ``ENUMERATE`` plans, every plan is priced
   and predicted (exact). Otherwise a Lagrangian coordinate descent finds, for a sweep of
   multipliers λ, plans minimising ``time / t_fp32 + λ (predicted / budget)²``; its moves
   change the default region, one variable, or a *block* — a run of consecutive layers
   set to one precision — so it crosses plans where every one-layer step adds a cast
   boundary (a one-layer walk stopped at the first feasible plan it met, although a plan
   with a block moved was faster and more accurate). Every plan it prices is kept.
2. **The walk.** Candidates in order of time (within ``TIE`` = 0.1 % of each other, the
   one predicted most accurate first); the next one to run is the fastest not yet measured
   (nor being measured by another worker, nor running the same plan as one of those: the
   same ``plan.schedule.signature``) whose corrected prediction is within the limit. The
   search is complete when the fastest remaining candidate is a measured feasible plan.
3. **Correction.** Measured errors correct the predictions (interactions between layers,
   the model's own code running in 16-bit): predictions are scaled by the median ratio
   measured / predicted of the plans measured so far (clipped to [0.5, 4]). The limit is
   ``margin`` x the budget; once ``SPREAD_AFTER`` plans have been measured it is also at
   most what the most optimistic measured ratio allows (plus ``SLACK``), so the walk
   stops measuring plan after plan just over the budget. A plan predicted no more
   accurate than one measured over budget is not measured at all (an 8 B Llama's walk
   measured eleven 16-layer plans of one speed, each 0.055-0.058 against a 0.05 budget,
   before this rule).

``benchmarks/tune_baselines.py`` checks the descent against enumeration where both run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from autoprec.cost import CostModel
from autoprec.formats.precisions import PRECISIONS
from autoprec.plan.schedule import signature
from autoprec.search.space import Key, SearchSpace, Variable, group_key

#: Spaces with at most this many plans are enumerated (all priced).
ENUMERATE = 2_000_000
#: Spaces of repeated blocks tied by position with at most this many plans are enumerated
#: (each plan is a replay of the whole forward: priced by the chunk, but not by millions).
TIED_ENUMERATE = 100_000
#: Plans priced per vectorised call.
CHUNK = 8192
#: Measured/predicted correction bounds.
CORRECTION = (0.5, 4.0)
#: Plans whose times differ by less than this fraction are equally fast to the walk: among
#: them, the one predicted most accurate is measured first (the result is within this
#: fraction of the fastest feasible plan).
TIE = 0.001
#: Measurements after which the limit also follows the most optimistic measured ratio.
SPREAD_AFTER = 3
#: Slack on that limit (a plan 5 % more optimistic than any measured so far is tried).
SLACK = 0.05


class PlanSpace:
    """Vectorised time and predicted error of plan keys of ``space``."""

    def __init__(self, space: SearchSpace, cost: CostModel,
                 estimate: Callable[[str, str], float] | None) -> None:
        self.space = space
        self.cost = cost
        self.rules = cost.rules(space.rule_paths)
        # squared per-variable estimates: (V, len(PRECISIONS)); the region adds nothing
        sq = np.zeros((len(space.variables), len(PRECISIONS)))
        for j, v in enumerate(space.variables):
            for c in v.choices:
                if c != "fp32" and estimate is not None:
                    sq[j, PRECISIONS.index(c)] = sum(estimate(lay, c) ** 2 for lay in v.layers)
        self._sq = sq

    def times(self, keys: np.ndarray) -> np.ndarray:
        keys = np.atleast_2d(np.asarray(keys, dtype=np.intp))
        out = np.empty(len(keys))
        for s in range(0, len(keys), CHUNK):
            part = keys[s:s + CHUNK]
            out[s:s + CHUNK] = self.cost.price(self.rules, self.space.codes(part)).time
        return out

    def time(self, key: Key) -> float:
        return float(self.times(np.array([key]))[0])

    def predicted(self, keys: np.ndarray) -> np.ndarray:
        keys = np.atleast_2d(np.asarray(keys, dtype=np.intp))
        if not self.space.variables:
            return np.zeros(len(keys))
        vals = self._sq[np.arange(len(self.space.variables))[None, :], keys[:, 1:]]
        return np.sqrt(vals.sum(axis=1))


def _choice_codes(space: SearchSpace) -> list[list[int]]:
    return [[PRECISIONS.index(c) for c in v.choices] for v in space.all_variables]


def enumerate_keys(space: SearchSpace) -> np.ndarray:
    """Every plan key of ``space`` (N, 1 + V)."""
    grids = np.meshgrid(*[np.array(c, dtype=np.int8) for c in _choice_codes(space)],
                        indexing="ij")
    return np.stack([g.reshape(-1) for g in grids], axis=1)


def _moves(space: SearchSpace, key: Key, choices: list[list[int]]) -> list[Key]:
    """Region changes, one-variable changes and block moves from ``key``.

    A block move sets a run of consecutive layer variables to one precision, alone or
    together with a change of the default region: from a tf32 plan, every one-layer step to
    fp16 adds a cast in and out and is slower, while the whole run in fp16 is faster.
    """
    out: set[Key] = set()
    n = len(key)
    for j in range(n):
        for c in choices[j]:
            if c != key[j]:
                out.add(key[:j] + (c,) + key[j + 1:])
    lengths = sorted({2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64} & set(range(2, n)) | {n - 1})
    codes = sorted({c for ch in choices[1:] for c in ch})
    for length in lengths:
        for start in range(1, n - length + 1):
            for c in codes:
                new = list(key)
                for j in range(start, start + length):
                    if c in choices[j]:
                        new[j] = c
                for r in choices[0]:
                    new[0] = r
                    new_key = tuple(new)
                    if new_key != key:
                        out.add(new_key)
    return sorted(out)


def _starts(space: SearchSpace, choices: list[list[int]]) -> list[Key]:
    """Every region with every layer at one precision (where allowed, else fp32)."""
    out = set()
    for r in choices[0]:
        for c in sorted({c for ch in choices[1:] for c in ch}):
            out.add((r, *[c if c in ch else ch[0] for ch in choices[1:]]))
    return sorted(out | {space.uniform(p) for p in PRECISIONS})


def descend(ps: PlanSpace, budget: float, lambdas: Iterable[float] | None = None,
            max_steps: int = 200) -> dict[Key, tuple[float, float]]:
    """Plans found by Lagrangian coordinate descent with block moves: {key: (time, pred)}.

    For each λ (increasing, warm-started from the previous solution), repeatedly take the
    best move while it lowers ``time / t_fp32 + λ (pred / budget)²``.
    """
    space = ps.space
    choices = _choice_codes(space)
    t32 = ps.cost.reference_time  # the model as given: fp32_time for an fp32 model
    seen: dict[Key, tuple[float, float]] = {}

    def score(keys: list[Key]) -> list[tuple[float, float]]:
        new = [k for k in keys if k not in seen]
        if new:
            arr = np.array(new, dtype=np.intp)
            for k, t, p in zip(new, ps.times(arr), ps.predicted(arr), strict=True):
                seen[k] = (float(t), float(p))
        return [seen[k] for k in keys]

    starts = _starts(space, choices)
    score(starts)
    lambdas = list(lambdas) if lambdas is not None else list(np.geomspace(1e-3, 1e3, 13))
    scale = max(budget, 1e-12)

    def objective(tp: tuple[float, float], lam: float) -> float:
        t, p = tp
        return t / t32 + lam * (p / scale) ** 2 if math.isfinite(t) else math.inf

    current = min(starts, key=lambda k: seen[k][0])
    for lam in lambdas:
        cands = [current, *starts]
        best = min(cands, key=lambda k: objective(seen[k], lam))
        for _ in range(max_steps):
            moves = _moves(space, best, choices)
            vals = score(moves)
            j = int(np.argmin([objective(v, lam) for v in vals]))
            if objective(vals[j], lam) >= objective(seen[best], lam) * (1 - 1e-12):
                break
            best = moves[j]
        current = best
    return seen


def tie_by_position(space: SearchSpace) -> tuple[SearchSpace, list[list[int]]] | None:
    """The space with the variables of repeated blocks tied by their position in the block
    (``h.3.attn.c_proj`` -> ``h.*.attn.c_proj``; a tied variable takes what all its
    members allow), and the members of each tied variable. None when nothing repeats."""
    groups: dict[str, list[int]] = {}
    for j, v in enumerate(space.variables):
        groups.setdefault(group_key(v.name), []).append(j)
    if len(groups) == len(space.variables):
        return None
    members = list(groups.values())
    tied = []
    for name, js in groups.items():
        vs = [space.variables[j] for j in js]
        tied.append(Variable(name, [lay for v in vs for lay in v.layers],
                             [c for c in vs[0].choices if all(c in v.choices for v in vs)]))
    return SearchSpace(tied, space.region, dict(space.locked)), members


def untie(keys: np.ndarray, members: list[list[int]], n_vars: int) -> np.ndarray:
    """Full keys (N, 1 + V) of tied keys (N, 1 + G)."""
    out = np.empty((len(keys), 1 + n_vars), dtype=np.int8)
    out[:, 0] = keys[:, 0]
    for g, js in enumerate(members):
        for j in js:
            out[:, 1 + j] = keys[:, 1 + g]
    return out


def refine(ps: PlanSpace, budget: float, seen: dict[Key, tuple[float, float]],
           lambdas: Iterable[float] | None = None, max_steps: int = 10,
           base: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """Per-layer refinements of the tied plans, for each λ and default region: from the
    best plan so far, price every one-variable change in one batch, apply all improving
    changes of distinct variables together when that improves ``time / t_fp32 + λ (pred /
    budget)²`` (else the single best one), until none improves. A step costs one batched
    replay, whatever the depth; every plan it prices is added to ``seen``. ``base``: plans
    already priced, as arrays (keys, times, predictions), starting points too."""
    space = ps.space
    choices = _choice_codes(space)
    t32 = ps.cost.reference_time  # the model as given: fp32_time for an fp32 model
    scale = max(budget, 1e-12)

    def score(keys: list[Key]) -> np.ndarray:
        new = [k for k in dict.fromkeys(keys) if k not in seen]
        if new:
            arr = np.array(new, dtype=np.intp)
            for k, t, p in zip(new, ps.times(arr), ps.predicted(arr), strict=True):
                seen[k] = (float(t), float(p))
        return np.array([seen[k] for k in keys])

    def objective(tp: np.ndarray, lam: float) -> np.ndarray:
        t, p = np.atleast_2d(tp).T
        return np.where(np.isfinite(t), t / t32 + lam * (p / scale) ** 2, np.inf)

    lambdas = list(lambdas) if lambdas is not None else list(np.geomspace(1e-3, 1e3, 13))
    regions = choices[0]
    for lam in lambdas:
        for region in regions:  # one start per default region: a one-layer step never
            best = _best_start(seen, base, region, lam, objective)  # crosses regions
            if best is None:
                continue
            for _ in range(max_steps):
                cur = float(objective(np.array(seen[best]), lam)[0])
                moves = [(j, c) for j in range(1, len(best)) for c in choices[j]
                         if c != best[j]]
                keys = [best[:j] + (c,) + best[j + 1:] for j, c in moves]
                if not keys:
                    break
                gain = cur - objective(score(keys), lam)
                if gain.max() <= cur * 1e-12:
                    break
                pick: dict[int, tuple[float, int]] = {}
                for (j, c), g in zip(moves, gain, strict=True):
                    if g > cur * 1e-12 and (j not in pick or g > pick[j][0]):
                        pick[j] = (float(g), c)
                joint = list(best)
                for j, (_g, c) in pick.items():
                    joint[j] = c
                single = keys[int(np.argmax(gain))]
                cand = [tuple(joint), single] if len(pick) > 1 else [single]
                best = cand[int(np.argmin(objective(score(cand), lam)))]


def _best_start(seen: dict[Key, tuple[float, float]],
                base: tuple[np.ndarray, np.ndarray, np.ndarray] | None, region: int,
                lam: float, objective: Callable[[np.ndarray, float], np.ndarray]
                ) -> Key | None:
    """The plan of ``region`` minimising the objective among ``seen`` and ``base``."""
    best, val = None, math.inf
    pool = [k for k in seen if k[0] == region]
    if pool:
        vals = objective(np.array([seen[k] for k in pool]), lam)
        i = int(np.argmin(vals))
        best, val = pool[i], float(vals[i])
    if base is not None:
        rows = np.flatnonzero(base[0][:, 0] == region)
        if rows.size:
            vals = objective(np.stack([base[1][rows], base[2][rows]], axis=1), lam)
            i = int(np.argmin(vals))
            if vals[i] < val:
                r = rows[i]
                best = tuple(int(c) for c in base[0][r])
                seen.setdefault(best, (float(base[1][r]), float(base[2][r])))
    return best


class Planner:
    """Candidate plans in order of time, and the rule for which one to measure next."""

    def __init__(self, space: SearchSpace, cost: CostModel,
                 estimate: Callable[[str, str], float] | None, *, budget: float,
                 margin: float = 1.25, prune: bool = True) -> None:
        self.space = space
        self.ps = PlanSpace(space, cost, estimate)
        self.budget = budget
        self.margin = margin
        self.prune = prune  # False (a metric budget): predictions are in other units
        if space.size <= ENUMERATE:
            keys = enumerate_keys(space)
            times = self.ps.times(keys)
            preds = self.ps.predicted(keys)
            self.method = "enumeration"
        else:
            tied = tie_by_position(space)
            if tied is not None:
                # repeated blocks: per-position plans (every one where TIED_ENUMERATE
                # allows, else the descent over them), then per-layer refinements
                tspace, members = tied
                tps = PlanSpace(tspace, cost, estimate)
                if tspace.size <= TIED_ENUMERATE:
                    tk = enumerate_keys(tspace)
                    tt, tp = tps.times(tk), tps.predicted(tk)
                else:
                    got = descend(tps, budget)
                    tk = np.array(list(got), dtype=np.int8)
                    tt = np.array([v[0] for v in got.values()])
                    tp = np.array([v[1] for v in got.values()])
                tkeys = untie(tk, members, len(space.variables))
                found: dict[Key, tuple[float, float]] = {}
                refine(self.ps, budget, found, base=(tkeys, tt, tp))
                self.method = "repetition"
            else:
                tkeys, tt, tp = None, np.empty(0), np.empty(0)
                found = descend(self.ps, budget)
                self.method = "descent"
            keys = np.array(list(found), dtype=np.int8).reshape(len(found), -1)
            times = np.array([v[0] for v in found.values()])
            preds = np.array([v[1] for v in found.values()])
            if tkeys is not None:  # the tied plans (a refinement may repeat one: kept once)
                keys = np.concatenate([tkeys, keys.reshape(-1, tkeys.shape[1])])
                times = np.concatenate([tt, times])
                preds = np.concatenate([tp, preds])
                keys, first = np.unique(keys, axis=0, return_index=True)
                times, preds = times[first], preds[first]
        finite = np.isfinite(times)
        keys, times, preds = keys[finite], times[finite], preds[finite]
        buckets = np.floor(np.log(times / times.min()) / np.log1p(TIE)) if len(times) else times
        order = np.lexsort((times, preds, buckets))
        self.keys = keys[order].astype(np.int8)
        self.times = times[order]
        self.preds = preds[order]
        self.priced = int(finite.size)
        self.correction = 1.0
        self.ratios: list[float] = []
        self._signatures: dict[Key, tuple] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def correct(self, measured: Mapping[Key, float]) -> float:
        """Update the correction from measured errors (median measured / predicted)."""
        ratios = []
        for key, err in measured.items():
            p = float(self.ps.predicted(np.array([key]))[0])
            if p > 0 and math.isfinite(err):
                ratios.append(err / p)
        if ratios:
            self.correction = float(np.clip(np.median(ratios), *CORRECTION))
        self.ratios = ratios
        return self.correction

    def limit(self) -> float:
        """The largest predicted (uncorrected) error the walk still measures."""
        limit = self.margin * self.budget / self.correction
        if len(self.ratios) >= SPREAD_AFTER:
            optimistic = max(min(self.ratios), CORRECTION[0]) * (1 - SLACK)
            limit = min(limit, self.budget / optimistic)
        return limit

    def signature(self, key: Key) -> tuple:
        """What ``key`` runs (``plan.schedule.signature``, cached): keys with one signature
        are one run (e.g. two default regions no op runs in once every GEMM is set); the
        two notions of "the same plan" are ``search.decode``'s."""
        sig = self._signatures.get(key)
        if sig is None:
            codes = self.space.codes(np.array([key], dtype=np.intp))
            sig = signature(self.ps.cost.price(self.ps.rules, codes).schedule, 0)
            self._signatures[key] = sig
        return sig

    def next(self, measured: Mapping[Key, float], feasible: Mapping[Key, bool],
             busy: Iterable[Key] = ()) -> Key | None:
        """The next plan to measure, or None when the search is complete.

        ``measured``: key -> measured error; ``feasible``: key -> within budget (on eval
        data too); ``busy``: keys other workers are measuring now.
        """
        self.correct(measured)
        busy = set(busy)
        limit = self.limit()
        # a plan predicted no more accurate than one measured over budget is not measured:
        # among equally fast plans the most accurate is tried first, and when it fails the
        # walk moves to slower, more accurate plans instead of its near-copies
        failed = [k for k in measured if not feasible.get(k)]
        bar = (float(self.ps.predicted(np.array(failed)).min()) if failed and self.prune
               else math.inf)
        # Keys already run (or running) by time: a key with one of these times may run
        # the same plan under another key (only then is its signature worth computing).
        seen = [(self.ps.time(k), k) for k in (*measured, *busy)]
        for i in range(len(self.keys)):
            key = tuple(int(c) for c in self.keys[i])
            if key in measured:
                if feasible.get(key):
                    return None  # the fastest remaining candidate is feasible: done
                continue
            if key in busy:
                continue
            if self.prune and (self.preds[i] > limit or self.preds[i] >= bar):
                continue
            t = float(self.times[i])
            same = [k for tk, k in seen if abs(tk - t) <= 1e-9 * t
                    and self.signature(k) == self.signature(key)]
            if same:
                if any(feasible.get(k) for k in same):
                    return None  # this plan, under another key, is measured feasible
                continue  # measured infeasible, or being measured
            return key
        return None

    def front(self, n: int, measured: Mapping[Key, float], busy: Iterable[Key] = ()
              ) -> Key | None:
        """For a Pareto front: the next unmeasured plan of ``n`` spread evenly along the
        predicted (time, error) front up to 3x the budget, fastest first."""
        busy = set(busy)
        best = math.inf
        front: list[int] = []
        for i in range(len(self.keys)):  # by time: a point is on the front when it is
            if self.preds[i] < best:     # more accurate than every faster one
                front.append(i)
                best = self.preds[i]
        if not front:
            return None
        front = [i for i in front if self.preds[i] <= 3 * self.budget] or front[-1:]
        at = np.unique(np.linspace(0, len(front) - 1, max(n, 2)).round().astype(int))
        for i in (front[j] for j in at):
            key = tuple(int(c) for c in self.keys[i])
            if key not in measured and key not in busy:
                return key
        return None


__all__ = ["ENUMERATE", "SLACK", "SPREAD_AFTER", "TIE", "PlanSpace", "Planner", "descend", "enumerate_keys", "refine", "tie_by_position",
           "untie"]
