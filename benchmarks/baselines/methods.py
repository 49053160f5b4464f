"""The baseline searches, each written against a :class:`~baselines.problem.Counter`.

All of them search plan keys of the space a tool without autoprec's probes would see
(:func:`baselines.problem.open_space`): per layer variable the precisions the graph allows
(fp8 only on 16-aligned Linear-like layers) on the target device, and the default region
(where the model's own code runs: fp32 / tf32 / bf16 / fp16).

Where a method needs "everything lowered", it starts from the *fastest* plan by the cost
model (:meth:`baselines.problem.Problem.fastest`: every plan priced where the space can be
enumerated, else the planner's descent on time alone) — on a small GEMM fp8 is slower than
fp16, and a tool that ignores it would start somewhere slower than it needs to. "Falling
back" a variable moves it to its next more precise choice (fp8 -> fp16 -> bf16 -> tf32 ->
fp32, the order of ``autoprec.formats.precisions.PRECISIONS``).

**The region.** The default region is the key's first variable, and the baselines search it
as the tools they copy search the rest of the model (their fallback lists cover every op,
the model's own code included), not held fixed:

- greedy by probe order falls it back *last* (after every layer variable is at fp32): the
  probes rate layers, not the region;
- Neural Compressor's ``basic`` treats it as one more item of its one-by-one and accumulated
  fallback, like any layer;
- segment bisection puts it first in the list it bisects (the model's own code runs before
  and between the GEMMs); a blocked region runs fp32;
- random search draws it like every other variable; uniform sets it with the layers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from autoprec.formats.precisions import PRECISIONS
from autoprec.probe.table import SensitivityTable
from autoprec.search.space import Key, SearchSpace

from .problem import Counter, Problem


def _codes(space: SearchSpace) -> list[list[int]]:
    """Per key position, the codes of its choices, most precise first."""
    return [[PRECISIONS.index(c) for c in v.choices] for v in space.all_variables]


def next_up(choices: list[int], current: int) -> int | None:
    """The next more precise choice above ``current`` (None at fp32)."""
    above = [c for c in choices if c < current]
    return above[-1] if above else None


def _set(key: Key, j: int, code: int) -> Key:
    return key[:j] + (code,) + key[j + 1:]


# -- 2. uniform precisions --------------------------------------------------------------------


def uniform(problem: Problem, count: Counter) -> None:
    """One global precision: the region and every layer at it where allowed, else at the
    nearest more precise choice (``SearchSpace.uniform``) — what ``torch.autocast``
    around the whole model gives (fp8: every eligible Linear in fp8 inside a fp16 region)."""
    for p in PRECISIONS:
        if p != "fp32":
            count(problem.space.uniform(p))


# -- 3. greedy per-layer fallback -------------------------------------------------------------


def _sensitivity(table: SensitivityTable, layers: list[str], p: str) -> float:
    total = 0.0
    for layer in layers:
        try:
            e = table.estimate(layer, p)
        except KeyError:  # no probe row: unknown, fall back last
            e = 0.0
        if math.isnan(e):
            e = 0.0
        total += e * e
    return math.sqrt(total)


def greedy_probe(problem: Problem, count: Counter, table: SensitivityTable) -> None:
    """All at the fastest plan; while over budget, move the layer variable whose current
    precision the probes rate most sensitive (the earliest on ties) one step up; once
    every layer is at fp32, the region. One evaluation per step."""
    key = problem.fastest()
    choices = _codes(problem.space)
    variables = problem.space.variables
    while not count(key).feasible:
        movable = [j for j in range(1, len(key)) if next_up(choices[j], key[j]) is not None]
        if movable:
            j = max(movable, key=lambda j: (
                _sensitivity(table, variables[j - 1].layers, PRECISIONS[key[j]]), -j))
        elif next_up(choices[0], key[0]) is not None:
            j = 0
        else:
            return
        key = _set(key, j, next_up(choices[j], key[j]))  # type: ignore[arg-type]


def greedy_inc(problem: Problem, count: Counter) -> None:
    """Intel Neural Compressor's ``basic`` strategy (neural_compressor/strategy/basic.py),
    with our precisions as its fallback dtypes and the region as one more item.

    Start at the fastest plan. Then for each fallback precision t, least precise first
    (INC: bf16, then fp32; here fp16, bf16, tf32, fp32): (a) "fallback one by one": from
    the start, move each item that can take t and is below it to t alone, bottom-up, one
    evaluation each; (b) "accumulated fallback": from the start again, move items to t
    cumulatively in order of the error they left in (a), smallest first, one evaluation
    per step. Stop at the first plan within budget (INC's default exit when the accuracy
    goal is met). The last step of t = fp32 is all-fp32, so the walk always ends feasible.
    """
    start = problem.fastest()
    if count(start).feasible:
        return
    choices = _codes(problem.space)
    for t in reversed(range(len(PRECISIONS))):
        items = [j for j in range(len(start)) if t in choices[j] and t < start[j]]
        if not items:
            continue
        impact: dict[int, float] = {}
        for j in reversed(items):  # INC: from bottom to up (the region, item 0, last)
            ev = count(_set(start, j, t))
            if ev.feasible:
                return
            impact[j] = ev.error
        acc = start
        for j in sorted(impact, key=lambda j: impact[j]):  # stable: ties keep bottom-up
            acc = _set(acc, j, t)
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
    (onnxconverter_common/auto_mixed_precision.py), over the key's variables (the region,
    then the layer variables in execution order) instead of ONNX nodes, and with each
    variable's precision in the fastest plan instead of fp16.

    The variables start as one untested segment. Repeatedly take the largest untested
    segment (the first on ties) and try it lowered together with every segment already
    known good, everything else fp32: within budget -> the segment is good; else a single
    variable is bad (stays fp32) and a longer segment splits in two halves. The result keeps
    the good segments lowered; it is validated once more (a repeat here, so free). One
    evaluation per attempt.
    """
    target = problem.fastest()
    fp32 = problem.fp32_key
    segs = [_Segment(len(target))]

    def attempt(skip: _Segment | None) -> bool:
        key, i = list(target), 0
        for s in segs:
            if s is not skip and not s.good:
                key[i:i + s.size] = fp32[i:i + s.size]
            i += s.size
        return count(tuple(key)).feasible

    while True:
        open_ = [s for s in segs if not s.good and not s.bad]
        if not open_:
            break
        seg = max(open_, key=lambda s: s.size)  # first of the largest, as onnx's get_largest
        if attempt(seg):
            seg.good = True
        elif seg.size == 1:
            seg.bad = True
        else:
            half = seg.size // 2
            i = segs.index(seg)
            segs[i:i + 1] = [_Segment(half), _Segment(seg.size - half)]
    attempt(None)


# -- 5. random search -------------------------------------------------------------------------


def random_search(problem: Problem, count: Counter, evaluations: float, seed: int) -> None:
    """Uniformly random plans (region and layers) until ``evaluations`` (full-set
    equivalents) are spent."""
    rng = random.Random(seed)
    choices = _codes(problem.space)
    tries = 0
    while count.evaluations < evaluations and tries < 100 * max(evaluations, 1.0) + 100:
        count(tuple(rng.choice(ch) for ch in choices))
        tries += 1


# -- the true optimum -------------------------------------------------------------------------


@dataclass
class Optimum:
    """The exhaustive answer: the fastest plan feasible on calibration data, and the fastest
    also within budget on eval data (the optimum)."""

    plans: int  # size of the space (all priced)
    walked: int  # keys visited (fastest first) before the optimum was found
    measured: int  # distinct plans among them (keys with one signature are one plan)
    calib_key: Key | None  # fastest within budget on calibration data
    calib_speedup: float
    calib_holds_on_eval: bool
    key: Key | None  # feasible on both (None: not found within the cap)
    speedup: float
    complete: bool  # False: stopped at max_evaluations before finding it


def exhaustive(problem: Problem, count: Counter, *,
               max_evaluations: float = 400.0) -> Optimum:
    """Exact optimum: every plan of the open space priced (``enumerate_keys`` +
    ``PlanSpace.times``), then measured in order of estimated time until the first one
    within budget on calibration *and* eval data. Every faster plan has been measured and
    found over budget, so this is the optimum of the full enumeration (w.r.t. the measured
    error and the cost model) without measuring the slower part of it. A key whose plan
    was already measured under another key is not run again (the Counter). Stops
    (``complete`` False) after ``max_evaluations`` evaluations."""
    keys, times = problem.model.priced(problem.plans)
    t32 = problem.model.cost.fp32_time
    calib: tuple[Key, float, bool] | None = None
    walked = 0
    found: tuple[Key, float] | None = None
    for i in np.argsort(times, kind="stable"):
        if not math.isfinite(times[i]) or count.evaluations >= max_evaluations:
            break
        key = tuple(int(c) for c in keys[i])
        ev = count(key)
        walked += 1
        if calib is None and ev.error <= problem.budget:
            calib = (key, float(t32 / times[i]), ev.feasible)
        if ev.feasible:
            found = key, float(t32 / times[i])
            break
    measured = len(count.by_signature) - 1  # all-fp32 is the Counter's free start
    return Optimum(len(keys), walked, measured, calib[0] if calib else None,
                   calib[1] if calib else math.nan, bool(calib and calib[2]),
                   found[0] if found else None, found[1] if found else math.nan,
                   found is not None)
