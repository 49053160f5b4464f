"""Timing rows on the device at hand: interleaved rounds, eager or compiled.

Every round runs each plan once in a fresh random order, each applied untimed before its
runs (``cost.measure_interleaved``), on one calibration batch: CPU on one torch thread
by the thread's CPU time, CUDA with events. The measured speed-up of a plan is the median
over rounds of fp32's time / its time in the same round; p10-p90 of those ratios is its
spread. Rounds go on (up to ``MAX_ROUNDS``, within ``TIME_BUDGET_S``) while the two
fastest plans still straddle each other.

A compiled deployment (``--compile``) is timed ``torch.compile``'d (``compiled_timer``):
one copy of the model per plan, the plan applied, compiled by one untimed forward, then
the same rounds. ``eval --measure`` and tune's last step both time through
``measure_rows``: one timing path.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autoprec.device.targets import is_cpu
from autoprec.evaluation.decision import (
    ColdConfirmed,
    Retimed,
    Timing,
    casts_per_call,
    cold_rows,
    contradictions,
    fastest_measured,
    fp32_row,
    keep_slower,
)
from autoprec.evaluation.rows import Row, Timer, fill_measured
from autoprec.policy import Policy, PolicyWarning
from autoprec.pricing.target import Target

#: Rounds of the interleaved timing: at least, at most (more while the best two overlap).
MIN_ROUNDS, MAX_ROUNDS = 7, 21


#: Wall seconds after which no further round starts (beyond MIN_ROUNDS).
TIME_BUDGET_S = 30.0


#: A timed sample runs the forward this long at least (several runs if it is shorter).
SAMPLE_S = 0.02


def interleaved_timer(model: Any, run: Callable[[], Any], device: str, target: str, *,
                      inner: int = 1, fp8_backend: str | None = None, seed: int = 0,
                      force: bool = False, cold: bool = False,
                      run_for: Callable[[Policy], Callable[[], Any]] | None = None) -> Timer:
    """A Timer for ``time_plans``: each plan applied around ``run()`` (the forward of one
    batch under ``torch.no_grad``), interleaved rounds on ``device`` (see the module doc).
    ``cold``: the allocator trimmed before every timed forward (``_rounds``). ``run_for``:
    each plan's own callable instead (a training step, with a GradScaler where it has fp16)."""
    from autoprec.apply.apply import apply_policy

    def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
        around = {name: (lambda pol=pol: apply_policy(model, pol, target=target, force=force,
                                                      fp8_backend=fp8_backend))
                  for name, pol in plans.items()}
        with _timing(device):
            runs = {n: run if run_for is None else run_for(pol) for n, pol in plans.items()}
            return _rounds(runs, device, inner, seed, around, cold=cold)

    return timer


@contextlib.contextmanager
def _timing(device: str) -> Iterator[None]:
    """Torch threads for timing on ``device``; the one-plan policies' warnings quiet."""
    from autoprec.measure import timing_threads

    with timing_threads(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        yield


def _rounds(runs: Mapping[str, Callable[[], Any]], device: str, inner: int, seed: int,
            around: Mapping[str, Callable[[], Any]] | None = None, *, cold: bool = False
            ) -> Mapping[str, Sequence[float]]:
    """The interleaved rounds every timer runs (see the module doc). ``cold``: glibc's
    ``malloc_trim(0)`` untimed before every timed forward, so each starts from an allocator
    that has handed its free memory back (``cold_confirm``)."""
    from autoprec.measure import allocator_trim, measure_interleaved

    return measure_interleaved(runs, device, around=around, rounds=MIN_ROUNDS,
                               max_rounds=MAX_ROUNDS, more=_undecided,
                               time_budget_s=TIME_BUDGET_S, inner=inner,
                               clock="thread" if is_cpu(device) else "wall", seed=seed,
                               before_each=allocator_trim() if cold else None)


def compiled_timer(model: Any, forward: Callable[[Any, Any], Any], batch: Any, device: str,
                   target: str, *, inner: int = 1, fp8_backend: str | None = None,
                   seed: int = 0, force: bool = False, cold: bool = False) -> Timer:
    """A Timer for ``time_plans`` that times plans as a ``torch.compile`` deployment runs
    them: per plan, a copy of ``model`` with the plan applied for the whole measurement
    (``apply_policy``, then ``torch.compile``: the README's deployment snippet), compiled
    by one untimed forward; then interleaved rounds as ``interleaved_timer``'s. One copy per
    plan because a compiled program keeps the policy it was traced under: applying
    another around it would recompile it in every round."""
    import copy

    import torch

    from autoprec.apply.apply import apply_policy
    from autoprec.fused import fused_paths_off

    def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
        handles, runs = [], {}
        limit = max(8, 2 * len(plans))  # each copy's forward is one more compiled entry
        with _timing(device), torch._dynamo.config.patch(recompile_limit=limit):
            torch._dynamo.reset()
            try:
                for name, pol in plans.items():
                    mine = copy.deepcopy(model)
                    handles.append(apply_policy(mine, pol, target=target, force=force,
                                                fp8_backend=fp8_backend))
                    compiled = torch.compile(mine)

                    def run(c: Any = compiled) -> Any:
                        with torch.no_grad(), fused_paths_off():
                            return forward(c, batch)

                    run()  # compiles (untimed)
                    runs[name] = run
                return _rounds(runs, device, inner, seed, cold=cold)
            finally:
                for h in handles:
                    h.remove()
                torch._dynamo.reset()

    return timer


def _undecided(samples: Mapping[str, Sequence[float]]) -> bool:
    """More rounds while the two fastest plans' per-round ratio straddles 1 (p10-p90)."""
    med = sorted((float(np.median(v)), k) for k, v in samples.items() if len(v))
    if len(med) < 2:
        return False
    a, b = np.asarray(samples[med[0][1]]), np.asarray(samples[med[1][1]])
    n = min(len(a), len(b))
    p10, p90 = np.percentile(b[:n] / a[:n], [10, 90])
    return bool(p10 < 1.0 < p90)


def _to_device(obj: Any, device: str) -> Any:
    """A batch on ``device``: tensors (and objects with ``.to``, e.g. a tokenizer's
    BatchEncoding) moved; dicts, lists and tuples rebuilt; other leaves kept."""
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj) if type(obj) in (list, tuple) \
            else obj
    to = getattr(obj, "to", None)
    return to(device) if callable(to) else obj


def measure_rows(rows: list[Row], forward: Callable[[Any, Any], Any], net: Any, batch: Any,
                 target: Target, at_batch: Any, *, timer: Timer | None = None,
                 seed: int = 0, force: bool = False,
                 loss: Callable[[Any, Any], Any] | None = None) -> Timing:
    """Time ``rows`` on the local ``target``'s device with ``forward(net, batch)`` (a copy
    of the model on a GPU), each plan applied as the target runs it (its fp8 backend)
    (``time_plans``); ``at_batch``: the cost model at the timed batch size (the estimate beside each
    measurement, and how many forwards make one sample). A compiled target (``--compile``)
    times each plan ``torch.compile``'d (``compiled_timer``). A training-form target with
    model.py's ``loss`` times each plan as a real training step instead (forward, loss,
    backward, AdamW; a GradScaler where it has fp16: ``measure.training_step``) on a copy of the
    model, eager."""
    import copy

    import torch

    device = target.device
    if device is None:
        raise ValueError(f"measure_rows: the {target.name} target is not this machine")
    if not is_cpu(device):
        net, batch = copy.deepcopy(net).to(device), _to_device(batch, device)
    for r in rows:
        if r.policy is not None:
            r.est_measured_batch = at_batch.speedup(r.policy)
    inner = max(1, min(50, math.ceil(SAMPLE_S / max(at_batch.fp32_time, 1e-9))))

    from autoprec.fused import fused_paths_off

    def run() -> Any:  # fused torch.nn fast paths off, as in every measured forward
        with torch.no_grad(), fused_paths_off():
            return forward(net, batch)

    how = ("1 torch thread, thread CPU time" if is_cpu(device) else "CUDA events") + (
        f", {inner} forwards per sample" if inner > 1 else "") + (
        ", torch.compile'd (one model copy per plan)" if target.compile else "")
    cold_timer = None
    if timer is None and loss is not None and target.step and not target.compile:
        timer, how = step_timer(net, forward, loss, batch, target, inner, seed, force), (
            how.replace("forwards", "steps") + ", training steps (forward, loss, backward, "
            "AdamW; GradScaler with fp16)")
    if timer is None:
        from autoprec.measure import allocator_trim

        kw = dict(inner=inner, seed=seed, force=force, fp8_backend=target.fp8_backend)

        def make(cold: bool) -> Timer:
            return (compiled_timer(net, forward, batch, device, target.name, cold=cold, **kw)
                    if target.compile else
                    interleaved_timer(net, run, device, target.name, cold=cold, **kw))

        timer = make(False)
        if is_cpu(device) and allocator_trim() is not None:
            cold_timer = make(True)
    return time_plans(rows, timer, device=device, batch_size=at_batch.batch_size, how=how,
                      cold_timer=cold_timer)


def time_plans(rows: list[Row], timer: Timer, *, device: str, batch_size: int | None = None,
               how: str = "", cold_timer: Timer | None = None) -> Timing:
    """Time the runnable rows with ``timer`` (one entry per distinct plan; rows of one
    plan share its figures, ``Row.same_as``) and fill their speed-ups; a measured order
    the estimate contradicts beyond both their errors (``decision.contradictions``) is timed
    once more (the pair and fp32, interleaved) before anything is decided on it; and the
    winner so far, where it casts its weights per call, is confirmed cold
    (``cold_confirm``). ``decision.decide`` decides on the rows as left here."""
    first: dict[Any, str] = {}
    for r in rows:
        if r.policy is None:
            continue
        if r.key in first:
            r.same_as = first[r.key]
        else:
            first[r.key] = r.name
    plans = {r.name: r.policy for r in rows if r.policy is not None and r.same_as is None}
    timed = timer(plans)  # measure_interleaved's Samples carry page faults per forward
    samples = dict(timed)
    fill_measured(rows, timed)
    bad = contradictions(rows)
    again = None
    if bad:
        base = fp32_row(rows)
        names = dict.fromkeys([base.same_as or base.name, *(x.name for ab in bad for x in ab)])
        before = {r.name: r.speedup for r in rows}
        second = timer({n: plans[n] for n in names})
        fill_measured([r for r in rows if (r.same_as or r.name) in names], second)
        a, b = bad[0]
        again = Retimed(tuple(n for n in names if n != (base.same_as or base.name)),
                        a.name, before[a.name], a.est_measured_batch, b.name, before[b.name],
                        b.est_measured_batch, still=bool(contradictions(rows)))
    winner, _why, _runner = fastest_measured(rows)
    cold = cold_confirm(rows, winner, cold_timer)
    n = min((len(v) for v in samples.values()), default=0)
    return Timing(device, batch_size, how, n, retimed=again, cold=cold)


def cold_confirm(rows: Sequence[Row], winner: Row | None, cold_timer: Timer | None
                 ) -> ColdConfirmed | None:
    """Before a plan that casts its weights on every call is written
    (``decision.casts_per_call``), time it, fp32 and the next two fastest rows again
    (``decision.cold_rows``) with the allocator trimmed before every forward, and keep each
    row's slower state (``decision.keep_slower``); the decision is made on the rows after.
    Returns what was done (None: nothing to confirm).

    Why: the per-call casts allocate fresh buffers every forward, and whether glibc serves
    them from fresh, faulting pages depends on what the process allocated before
    (benchmarks/results/page_faults.md: examples/wide's global bf16 autocast ran 2.44x of fp32
    with freed memory kept, 1.08x with ~14,500 faults per forward). A plan measured in the
    lucky state alone must not be written: issue 29's tune wrote an autocast plan it
    measured at 1.43x where ``eval --measure`` measured 0.79x."""
    if (cold_timer is None or winner is None or winner.policy is None
            or not casts_per_call(winner.policy)):
        return None
    names = cold_rows(rows, winner)
    plans = {r.name: r.policy for r in rows if r.name in names and r.policy is not None}
    got = cold_timer(plans)
    shadow = [copy.copy(r) for r in rows if (r.same_as or r.name) in names]
    fill_measured(shadow, got)
    return ColdConfirmed(winner.name, tuple(names), keep_slower(rows, shadow, names))



def step_timer(net: Any, forward: Callable[[Any, Any], Any], loss: Callable[[Any, Any], Any],
                batch: Any, target: Target, inner: int, seed: int, force: bool) -> Timer:
    """``interleaved_timer`` over training steps of one copy of ``net`` (its own AdamW per
    plan, a GradScaler for a plan with fp16)."""
    import copy

    from autoprec.measure import training_step, uses_fp16

    mine = copy.deepcopy(net)
    steps: dict[tuple, Callable[[], Any]] = {}

    def run_for(pol: Policy) -> Callable[[], Any]:
        key = (pol.default, tuple(sorted(pol.layers.items())), pol.form)
        if key not in steps:
            steps[key] = training_step(mine, forward, loss, batch, fp16=uses_fp16(pol))
        return steps[key]

    steps_of = interleaved_timer(mine, lambda: None, target.device or "cpu", target.name,
                                 inner=inner, seed=seed, force=force,
                                 fp8_backend=target.fp8_backend, run_for=run_for)

    def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
        # a deploy-form row (16-bit stored weights) does not train: not timed as a step
        return steps_of({n: p for n, p in plans.items() if p.form == "train"})

    return timer

__all__ = ["MAX_ROUNDS", "MIN_ROUNDS", "SAMPLE_S", "TIME_BUDGET_S", "cold_confirm",
           "compiled_timer", "interleaved_timer", "measure_rows", "step_timer", "time_plans"]
