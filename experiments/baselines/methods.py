"""The baseline searches, each written against a :class:`~baselines.problem.Counter`.

All of them search the space a tool without autoprec's probes would see: per layer, the
precisions the graph allows (fp8 only on 16-aligned Linear-like layers) on the target
device. Where a method needs "everything lowered", it starts from the *fastest*
assignment by the cost model (:func:`fastest`: per variable the choice that minimises
the estimated time given the others, a few coordinate-descent passes from the fastest
uniform precision) — on a small GEMM fp8 is slower than fp16, and a tool that ignores it
would start somewhere slower than it needs to. "Falling back" a layer moves it to the
next more precise choice it has (fp8 -> fp16 -> bf16 -> tf32 -> fp32, the order of
``autoprec.precisions.PRECISIONS``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from autoprec.precisions import PRECISIONS
from autoprec.probe.table import SensitivityTable
from autoprec.search import walk
from autoprec.search.space import SearchSpace, Variable

from .problem import Counter, Problem


def _rank(p: str) -> int:
    return PRECISIONS.index(p)


def time_of(problem: Problem) -> Callable[[Mapping[str, str]], float]:
    cost, space = problem.model.cost, problem.space
    return lambda params: cost.estimate(space.assignment(params))


def fastest(problem: Problem, passes: int = 3) -> dict[str, str]:
    """The fastest assignment by the cost model (no evaluation): tune's own search."""
    timer = walk.SpaceTimer(problem.space, problem.model.cost)
    return timer.params(walk.fastest(problem.space, timer, passes))


def next_up(v: Variable, current: str) -> str | None:
    """The next more precise choice of ``v`` above ``current`` (None at fp32)."""
    above = [c for c in reversed(v.choices) if _rank(c) < _rank(current)]
    return above[0] if above else None


# -- 2. uniform precisions --------------------------------------------------------------------


def uniform(problem: Problem, count: Counter) -> None:
    """Each precision on every layer that may take it (the others at the nearest more
    precise choice they have, as ``SearchSpace.uniform`` does): what ``torch.autocast``
    around the whole model, or fp8 on every eligible Linear, gives."""
    for p in problem.model.precisions:
        if p != "fp32":
            count(problem.space.uniform(p))


# -- 3. greedy per-layer fallback -------------------------------------------------------------


def _sensitivity(table: SensitivityTable, v: Variable, p: str) -> float:
    total = 0.0
    for layer in v.layers:
        try:
            e = table.estimate(layer, p)
        except KeyError:  # no probe row (e.g. a container): unknown, fall back last
            e = 0.0
        if math.isnan(e):
            e = 0.0
        total += e * e
    return math.sqrt(total)


def greedy_probe(problem: Problem, count: Counter, table: SensitivityTable) -> None:
    """All layers at their fastest; while over budget, move the layer whose current
    precision the probes rate most sensitive one step up. One evaluation per step."""
    params = fastest(problem)
    order = {v.name: i for i, v in enumerate(problem.space.variables)}
    while True:
        if count(params).feasible:
            return
        movable = [v for v in problem.space.variables
                   if next_up(v, params[v.name]) is not None]
        if not movable:
            return
        v = max(movable, key=lambda v: (_sensitivity(table, v, params[v.name]), -order[v.name]))
        params = {**params, v.name: next_up(v, params[v.name])}


def greedy_inc(problem: Problem, count: Counter) -> None:
    """Intel Neural Compressor's ``basic`` strategy (neural_compressor/strategy/basic.py),
    with our precisions as its fallback dtypes.

    Start with everything at its fastest. Then for each fallback precision t, least precise
    first (INC: bf16, then fp32; here fp16, bf16, tf32, fp32): (a) "fallback one by one":
    from the all-fastest start, move each layer that can take t and is below it to t
    alone, bottom-up, one evaluation each; (b) "accumulated fallback": from the start
    again, move layers to t cumulatively in order of the error they left in (a), smallest
    first, one evaluation per step. Stop at the first assignment within budget (INC's
    default exit when the accuracy goal is met). The last step of t = fp32 is all-fp32,
    so the walk always ends feasible.
    """
    start = fastest(problem)
    if count(start).feasible:
        return
    variables = problem.space.variables
    for t in reversed(PRECISIONS):
        items = [v for v in variables if t in v.choices and _rank(t) < _rank(start[v.name])]
        if not items:
            continue
        impact: dict[str, float] = {}
        for v in reversed(items):  # INC: from bottom to up
            ev = count({**start, v.name: t})
            if ev.feasible:
                return
            impact[v.name] = ev.error
        acc = dict(start)
        for name in sorted(impact, key=lambda n: impact[n]):  # stable: ties keep bottom-up
            acc[name] = t
            if count(acc).feasible:
                return


# -- 4. segment bisection ---------------------------------------------------------------------


@dataclass
class _Segment:
    size: int
    good: bool = False
    bad: bool = False


def segment_bisect(problem: Problem, count: Counter) -> None:
    """onnxconverter-common's ``auto_convert_mixed_precision``
    (onnxconverter_common/auto_mixed_precision.py), over GEMM layers instead of ONNX nodes
    and with each layer's fastest precision instead of fp16.

    The layers, in execution order, start as one untested segment. Repeatedly take the
    largest untested segment (the first on ties) and try it lowered together with every
    segment already known good, everything else in fp32: within budget -> the segment is
    good; else a single layer is bad (stays fp32) and a longer segment splits in two
    halves. The result keeps the good segments lowered; it is validated once more (a
    repeat here, so free). One evaluation per attempt.
    """
    variables = problem.space.variables
    target = fastest(problem)
    segs = [_Segment(len(variables))]

    def blocked(skip: _Segment | None) -> set[str]:
        out, i = set(), 0
        for s in segs:
            if s is not skip and not s.good:
                out.update(v.name for v in variables[i : i + s.size])
            i += s.size
        return out

    def attempt(block: set[str]) -> bool:
        params = {v.name: problem.space.default if v.name in block else target[v.name]
                  for v in variables}
        return count(params).feasible

    while True:
        open_ = [s for s in segs if not s.good and not s.bad]
        if not open_:
            break
        seg = max(open_, key=lambda s: s.size)  # first of the largest, as onnx's get_largest
        if attempt(blocked(seg)):
            seg.good = True
        elif seg.size == 1:
            seg.bad = True
        else:
            half = seg.size // 2
            i = segs.index(seg)
            segs[i : i + 1] = [_Segment(half), _Segment(seg.size - half)]
    attempt(blocked(None))


# -- 5. random search -------------------------------------------------------------------------


def random_search(problem: Problem, count: Counter, evaluations: float, seed: int) -> None:
    """Uniform random assignments until ``evaluations`` (full-set equivalents) are spent."""
    rng = random.Random(seed)
    variables = problem.space.variables
    tries = 0
    while count.evaluations < evaluations and tries < 100 * max(evaluations, 1.0) + 100:
        count({v.name: rng.choice(v.choices) for v in variables})
        tries += 1


# -- the true optimum -------------------------------------------------------------------------


@dataclass
class Optimum:
    """The exhaustive answer: fastest assignment feasible on calibration data, and the
    fastest also within budget on eval data."""

    assignments: int  # size of the space
    walked: int  # assignments evaluated (fastest first) before both answers were found
    calib_params: dict[str, str] | None
    calib_speedup: float
    calib_holds_on_eval: bool
    params: dict[str, str] | None  # feasible on both
    speedup: float
    eval_error: float
    complete: bool  # False: stopped at max_evaluations before finding them


def _all_params(space: SearchSpace) -> list[dict[str, str]]:
    names = [v.name for v in space.variables]
    return [dict(zip(names, combo))
            for combo in itertools.product(*(v.choices for v in space.variables))]


def subspace(space: SearchSpace, precisions: tuple[str, ...]) -> SearchSpace:
    """The same variables restricted to ``precisions`` (fp32 always kept)."""
    return SearchSpace([Variable(v.name, v.layers,
                                 [c for c in v.choices if c in precisions or c == space.default],
                                 v.excluded) for v in space.variables],
                       space.locked, space.default)


def enumerate_all(problem: Problem, count: Counter, space: SearchSpace) -> int:
    """Evaluate every assignment of ``space`` (the brute-force cross-check)."""
    every = _all_params(space)
    for params in every:
        count(params)
    return len(every)


def exhaustive(problem: Problem, count: Counter, *, space: SearchSpace | None = None,
               max_assignments: int = 50_000,
               max_evaluations: float = 5_000.0) -> Optimum | None:
    """Exact optimum by enumeration, evaluated fastest-first.

    Every assignment of the space is priced (the cost model is cheap and vectorised); they
    are evaluated in order of estimated time, and the walk stops at the first one within
    budget on calibration data *and* eval data. Every faster assignment has been evaluated
    and found over budget, so this is the optimum of the full enumeration without
    evaluating the slower part of it. Screening (a quarter of the batches first, rejected
    at 3x the budget) is exact for relative L2 whenever that quarter carries at least 1/9
    of the reference's squared norm, as with our i.i.d. batches.
    """
    space, cost = space or problem.space, problem.model.cost
    if space.size > max_assignments:
        return None
    every = _all_params(space)
    codes = np.stack([cost.encode(space.assignment(p)) for p in every])
    times = np.asarray(cost.estimate_codes(codes))
    fp32 = cost.estimate({})
    calib = None
    walked = 0
    for i in np.argsort(times, kind="stable"):
        params = every[int(i)]
        ev = count(params)
        walked += 1
        if ev.feasible:
            eval_err = problem.eval_error(params)
            ok = eval_err <= problem.budget
            if calib is None:
                calib = (params, fp32 / times[i], ok)
            if ok:
                return Optimum(len(every), walked, calib[0], calib[1], calib[2], params,
                               fp32 / times[i], eval_err, True)
        if count.evaluations >= max_evaluations:
            break
    return Optimum(len(every), walked, calib[0] if calib else None,
                   calib[1] if calib else math.nan, bool(calib and calib[2]), None, math.nan,
                   math.nan, False)


# -- a suggestion for tune, prototyped here ---------------------------------------------------


