"""The winner timed on the device at hand, beside its baselines.

Every result is shown next to what a user could write instead of a tuned policy: all
fp32, one global ``torch.autocast`` in bf16 and in fp16, uniform tf32 (where the target
has it), and the one line every deployment uses, ``model.to(torch.bfloat16)`` /
``model.to(torch.float16)`` with its inputs cast — each as the policy ``default: <p>``
with no rules, in the train form (autocast) or the deploy form (weights stored 16-bit),
which runs as that one line does (experiments/apply_overhead.py: within 3 %;
tests/plan/test_what_runs_is_priced.py: the deploy form's ``default: bf16`` runs the very
ops ``model.to(bf16)`` runs). Each row has its error (eval data, the
budget's units) and its estimated speed-up, priced the same way as the tuned plan.

Where the target is the device at hand (``local_profile.speed_source``), the last step of
a tune times the chosen plan, the next fastest feasible candidates and the baselines,
interleaved (``cost.measure_interleaved``: every round runs each plan once in a fresh
random order, each applied untimed before its runs), on one calibration batch: CPU on one
torch thread by the thread's CPU time, CUDA with events. The measured speed-up of a plan
is the median over rounds of fp32's time / its time in the same round; p10-p90 of those
ratios is its spread. The written plan is the fastest *measured* one within budget
(``decide``): a tuned plan measured slower than fp32 or a one-liner within budget is never
written — the next candidate or the baseline is, and the reason says why.

A tune for a compiled deployment (``--compile``) times every row ``torch.compile``'d
(``compiled_timer``): one copy of the model per plan, the plan applied, compiled by one
untimed forward, then the same interleaved rounds.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoprec.policy import Policy, PolicyWarning

#: Baseline rows, in this order: what a user writes instead of a tuned policy, as
#: (precision, form): the uniform plan ``default: precision`` in that form.
BASELINES: tuple[tuple[str, str], ...] = (
    ("fp32", "train"), ("bf16", "train"), ("fp16", "train"), ("tf32", "train"),
    ("bf16", "deploy"), ("fp16", "deploy"))
#: Candidates from the study timed after the chosen one (the next fastest feasible ones).
NEXT_CANDIDATES = 2
#: Rounds of the interleaved timing: at least, at most (more while the best two overlap).
MIN_ROUNDS, MAX_ROUNDS = 7, 21
#: Wall seconds after which no further round starts (beyond MIN_ROUNDS).
TIME_BUDGET_S = 30.0
#: A timed sample runs the forward this long at least (several runs if it is shorter).
SAMPLE_S = 0.02

#: How far the estimate may be off (issue 29 holds it to 20 %): a measured order that
#: contradicts the estimated one by more than that on both rows, and by more than the
#: noise, is timed again before anything is written (``contradictions``).
RETIME_MARGIN = 0.2

Timer = Callable[[Mapping[str, Policy]], Mapping[str, Sequence[float]]]


def label(p: str, form: str = "train") -> str:
    """How a baseline row is named: what a user would write."""
    if form == "deploy" and p in ("bf16", "fp16"):
        return f"{p} (model.to({'bfloat16' if p == 'bf16' else 'float16'}))"
    return {"fp32": "fp32 (no autocast)", "tf32": "tf32 (global flag)"}.get(
        p, f"{p} (one global autocast)")


@dataclass
class Row:
    """One plan beside the others: the tuned one, a next candidate, or a baseline."""

    name: str
    role: str  # "tuned" | "candidate" | "baseline"
    policy: Policy | None  # None: the target cannot run it (``why_not``)
    error: float | None = None  # budget units, on the eval data (calibration if unconfirmed)
    feasible: bool = False  # within budget and may be written
    est_speedup: float | None = None  # over fp32, at the deployment batch size
    why_not: str = ""  # why it is not a choice (cannot run / over budget / not asked for)
    trial: int | None = None
    est_measured_batch: float | None = None  # the estimate at the batch it was timed on
    speedup: float | None = None  # measured, over fp32 (median of per-round ratios)
    p10: float | None = None
    p90: float | None = None
    same_as: str | None = None  # timed once with this row (the same plan)
    source: Any = None  # the caller's object behind the row (a study candidate, ...)
    weight_bytes: int | None = None  # the weights the applied plan holds on the device

    @property
    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]] | None:
        """The plan: two rows of one key run the same (form, default and rules)."""
        if self.policy is None:
            return None
        from autoprec.search.decode import plan_id

        return plan_id(self.policy.default, self.policy.layers, self.policy.form)

    def to_dict(self) -> dict[str, Any]:
        def num(x: float | None, nd: int = 4) -> Any:
            if x is None:
                return None
            return round(x, nd) if math.isfinite(x) else ("inf" if x > 0 else "nan")

        out: dict[str, Any] = {"name": self.name, "role": self.role,
                               "error": num(self.error, 6), "feasible": self.feasible,
                               "est_speedup": num(self.est_speedup),
                               "measured_speedup": num(self.speedup),
                               "measured_p10": num(self.p10), "measured_p90": num(self.p90),
                               "weight_bytes": self.weight_bytes}
        if self.policy is not None:
            out["policy"] = {"default": self.policy.default, "layers": dict(self.policy.layers),
                             "form": self.policy.form}
        if self.trial is not None:
            out["trial"] = self.trial
        if self.why_not:
            out["why_not"] = self.why_not
        if self.same_as:
            out["same_as"] = self.same_as
        return out


@dataclass
class SpeedCheck:
    """The rows, the plan to write and why; how and where they were timed."""

    rows: list[Row]
    winner: Row | None  # None: nothing feasible measured (or not measured at all)
    reason: str
    device: str | None = None  # where the rows were timed; None: estimated only
    batch_size: int | None = None
    how: str = ""  # clock, threads, rounds
    rounds: int = 0
    mark: str = "written"  # what the winner's row is marked with
    retimed: tuple[str, ...] = ()  # rows timed again: their first timing contradicted the estimate

    @property
    def measured(self) -> bool:
        return self.device is not None

    def recommendation(self) -> str:
        """Which one a user should pick (by measured speed where timed, else estimated)."""
        ok = [r for r in self.rows if r.feasible and r.policy is not None]
        if not ok:
            return "nothing within budget: keep fp32"
        fast = max(ok, key=lambda r: _speed(r, self.measured))
        what = "measured" if self.measured else "estimated"
        if fast.role == "baseline":
            return (f"{fast.name}: the fastest within budget ({what} "
                    f"{_speed(fast, self.measured):.2f}x); the tuned plan does not beat it")
        return f"{fast.name} ({what} {_speed(fast, self.measured):.2f}x)"

    def to_dict(self) -> dict[str, Any]:
        return {"measured_on": self.device, "measured_batch_size": self.batch_size,
                "timing": self.how, "rounds": self.rounds,
                "chosen": None if self.winner is None else self.winner.name,
                "mark": self.mark, "retimed": list(self.retimed),
                "reason": self.reason, "recommendation": self.recommendation(),
                "rows": [r.to_dict() for r in self.rows]}

    def table(self) -> str:
        """The rows for people, one per plan."""
        return format_rows(self.to_dict())


def format_rows(check: Mapping[str, Any]) -> str:
    """``SpeedCheck.to_dict()`` as a table for people (tune's summary, eval)."""
    head = ("plan", "error", "est. speed-up", "measured (p10-p90)", "weights",
            "within budget")
    cells = []
    for r in check["rows"]:
        err = "-" if r["error"] is None else _g(r["error"])
        est = "-" if r["est_speedup"] is None else f"{_g(r['est_speedup'], '.2f')}x"
        if r["measured_speedup"] is not None:
            meas = (f"{r['measured_speedup']:.2f}x ({r['measured_p10']:.2f}-"
                    f"{r['measured_p90']:.2f})")
        else:
            meas = "-" if check["measured_on"] or r.get("policy") is None else "not measured"
        ok = "yes" if r["feasible"] else (r.get("why_not") or "no")
        wb = r.get("weight_bytes")
        weights = "-" if wb is None else f"{wb / 1e6:.1f} MB"
        name = r["name"] + (f" <- {check['mark']}" if r["name"] == check["chosen"] else "")
        name += f" (= {r['same_as']})" if r.get("same_as") else ""
        cells.append((name, err, est, meas, weights, ok))
    widths = [max(len(str(c[i])) for c in [head, *cells]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [head, *cells]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _g(x: Any, spec: str = ".4g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _speed(r: Row, measured: bool) -> float:
    v = r.speedup if measured and r.speedup is not None else r.est_speedup
    return -math.inf if v is None else v


# -- timing and the decision (pure: the timer is passed in) --------------------------------

def fill_measured(rows: Sequence[Row], samples: Mapping[str, Sequence[float]]) -> None:
    """Speed-ups over the fp32 row from per-round seconds keyed by row name (rows timed
    with another row of the same plan share its samples)."""
    base = next((r for r in rows if r.role == "baseline" and r.policy is not None
                 and r.policy.default == "fp32" and not r.policy.layers), None)
    if base is None or (base.same_as or base.name) not in samples:
        raise ValueError("fill_measured: the fp32 baseline must be timed")
    ref = np.asarray(samples[base.same_as or base.name], dtype=float)
    for r in rows:
        s = samples.get(r.same_as or r.name)
        if s is None or len(s) == 0:
            continue
        n = min(len(s), len(ref))
        ratio = ref[:n] / np.asarray(s, dtype=float)[:n]
        p10, med, p90 = np.percentile(ratio, [10, 50, 90])
        r.speedup, r.p10, r.p90 = float(med), float(p10), float(p90)


def _overlap(a: Row, b: Row) -> bool:
    """The two rows' p10-p90 ranges of per-round speed-ups overlap: as fast within the
    noise of this measurement."""
    if None in (a.p10, a.p90, b.p10, b.p90):
        return a.speedup == b.speedup
    return bool(a.p10 <= b.p90 and b.p10 <= a.p90)


def _rules(r: Row) -> int:
    return 0 if r.policy is None else len(r.policy.layers)


def decide(rows: Sequence[Row]) -> tuple[Row | None, str]:
    """The measured row to write within budget, and why: the fastest, unless a simpler one
    (fewer rules: a one-liner has none) is as fast within the noise — their p10-p90 ranges
    overlap — then the simplest of those (among equals the one holding fewer weight bytes,
    then the faster median). A tuned plan measured slower than a baseline or another
    candidate is never the choice."""
    timed = [r for r in rows if r.feasible and r.speedup is not None]
    if not timed:
        return None, "nothing within budget was measured"
    fastest = timed[0]
    for r in timed[1:]:
        if r.speedup > fastest.speedup:  # strict: the earlier row (the tuned plan) keeps ties
            fastest = r
    ties = [r for r in timed if _overlap(r, fastest)]
    best = min(ties, key=lambda r: (_rules(r), r.weight_bytes or 0, -(r.speedup or 0.0),
                                    timed.index(r)))
    if best is not fastest and (_rules(best), best.weight_bytes or 0) < (
            _rules(fastest), fastest.weight_bytes or 0):
        return best, (f"{best.name} ({_rules(best)} rules) measured {best.speedup:.2f}x "
                      f"(p10-p90 {best.p10:.2f}-{best.p90:.2f}x), {fastest.name} "
                      f"({_rules(fastest)} rules) {fastest.speedup:.2f}x (p10-p90 "
                      f"{fastest.p10:.2f}-{fastest.p90:.2f}x): as fast within the noise, "
                      "the simpler plan is written"
                      + ("" if _rules(best) < _rules(fastest) else
                         f" (it holds {(best.weight_bytes or 0) / 1e6:.1f} MB of weights, "
                         f"{fastest.name} {(fastest.weight_bytes or 0) / 1e6:.1f} MB)"))
    best = fastest
    tuned = next((r for r in rows if r.role == "tuned"), None)
    plan = best.same_as or best.name  # rows of the same plan are not a runner-up
    others = sorted((r for r in timed if (r.same_as or r.name) != plan),
                    key=lambda r: -(r.speedup or 0))
    runner = f"; next {others[0].name} {others[0].speedup:.2f}x" if others else ""
    if tuned is None or best is tuned:
        return best, (f"{best.name} measured {best.speedup:.2f}x over fp32 (p10-p90 "
                      f"{best.p10:.2f}-{best.p90:.2f}x), the fastest within budget{runner}")
    if tuned.speedup is None:
        why = f"{tuned.name} could not be timed ({tuned.why_not or 'not runnable'})"
    else:
        est = "" if tuned.est_speedup is None else f" (est. {tuned.est_speedup:.2f}x)"
        over = "" if tuned.feasible else ", over budget,"
        why = f"{tuned.name}{est}{over} measured {tuned.speedup:.2f}x over fp32"
    tie = ("" if tuned.p90 is None or best.p10 is None or tuned.p90 < best.p10 else
           "; their p10-p90 overlap: as fast within the noise, the faster median is kept")
    return best, (f"{why}, slower than {best.name} at {best.speedup:.2f}x (p10-p90 "
                  f"{best.p10:.2f}-{best.p90:.2f}x){tie}")


def contradictions(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """Pairs (a, b) of distinct timed plans where a measured faster than b beyond the noise
    (a's p10 above b's p90) while the estimate at the timed batch has b faster, and that
    flip is more than the estimate's error: a's estimate more than ``RETIME_MARGIN`` below
    a's p10, or b's more than it above b's p90. (The issue's run that wrote a plan slower
    than fp32: one global bf16 autocast measured 1.43x, p10 1.22x, estimated ~0.85x.)"""
    m = 1.0 + RETIME_MARGIN
    timed = [r for r in rows if r.speedup is not None and r.p10 is not None
             and r.p90 is not None and r.same_as is None and r.est_measured_batch]
    out = []
    for a in timed:
        for b in timed:
            if a is b or not (a.p10 > b.p90 and a.est_measured_batch < b.est_measured_batch):
                continue
            if a.est_measured_batch * m < a.p10 or b.est_measured_batch > b.p90 * m:
                out.append((a, b))
    return out


def check_speed(rows: list[Row], timer: Timer | None, *, device: str | None = None,
                batch_size: int | None = None, how: str = "") -> SpeedCheck:
    """Time the runnable rows with ``timer`` (one entry per distinct plan) and decide; with
    no timer (a remote target) the rows keep their estimates and the tuned row stands."""
    if timer is None:
        tuned = next((r for r in rows if r.role == "tuned"), None)
        return SpeedCheck(rows, tuned, "estimated only (the target is not this machine)")
    first: dict[Any, str] = {}
    for r in rows:
        if r.policy is None:
            continue
        if r.key in first:
            r.same_as = first[r.key]
        else:
            first[r.key] = r.name
    plans = {r.name: r.policy for r in rows if r.policy is not None and r.same_as is None}
    samples = dict(timer(plans))
    fill_measured(rows, samples)
    # a measured order the estimate contradicts beyond both their errors: timed once more
    # (the pair and fp32, interleaved) before anything is decided on it
    bad = contradictions(rows)
    again: tuple[str, ...] = ()
    note = ""
    if bad:
        base = next(r for r in rows if r.role == "baseline" and r.policy is not None
                    and r.policy.default == "fp32" and not r.policy.layers)
        names = dict.fromkeys([base.same_as or base.name, *(x.name for ab in bad for x in ab)])
        before = {r.name: r.speedup for r in rows}
        second = timer({n: plans[n] for n in names})
        fill_measured([r for r in rows if (r.same_as or r.name) in names], second)
        again = tuple(n for n in names if n != (base.same_as or base.name))
        a, b = bad[0]
        note = (f" [re-timed {', '.join(again)}: {a.name} first measured {before[a.name]:.2f}x"
                f" against {b.name}'s {before[b.name]:.2f}x, the estimate "
                f"{a.est_measured_batch:.2f}x vs {b.est_measured_batch:.2f}x; "
                + ("still contradicted: the measurement stands]" if contradictions(rows)
                   else "the second timing no longer contradicts the estimate]"))
    winner, reason = decide(rows)
    n = min((len(v) for v in samples.values()), default=0)
    return SpeedCheck(rows, winner, reason + note, device, batch_size, how, n, retimed=again)


def interleaved_timer(model: Any, run: Callable[[], Any], device: str, target: str, *,
                      inner: int = 1, fp8_backend: str | None = None, seed: int = 0,
                      force: bool = False) -> Timer:
    """A Timer for ``check_speed``: each plan applied around ``run()`` (the forward of one
    batch under ``torch.no_grad``), interleaved rounds on ``device`` (see the module doc)."""
    from autoprec.apply.apply import apply_policy

    def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
        around = {name: (lambda pol=pol: apply_policy(model, pol, target=target, force=force,
                                                      fp8_backend=fp8_backend))
                  for name, pol in plans.items()}
        with _timing(device):
            return _rounds({n: run for n in plans}, device, inner, seed, around)

    return timer


@contextlib.contextmanager
def _timing(device: str) -> Iterator[None]:
    """Torch threads for timing on ``device``; the one-plan policies' warnings quiet."""
    from autoprec.cost.machine import timing_threads

    with timing_threads(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        yield


def _rounds(runs: Mapping[str, Callable[[], Any]], device: str, inner: int, seed: int,
            around: Mapping[str, Callable[[], Any]] | None = None
            ) -> Mapping[str, Sequence[float]]:
    """The interleaved rounds every timer runs (see the module doc)."""
    from autoprec.cost.measure import measure_interleaved

    return measure_interleaved(runs, device, around=around, rounds=MIN_ROUNDS,
                               max_rounds=MAX_ROUNDS, more=_undecided,
                               time_budget_s=TIME_BUDGET_S, inner=inner,
                               clock="thread" if device == "cpu" else "wall", seed=seed)


def compiled_timer(model: Any, forward: Callable[[Any, Any], Any], batch: Any, device: str,
                   target: str, *, inner: int = 1, fp8_backend: str | None = None,
                   seed: int = 0, force: bool = False) -> Timer:
    """A Timer for ``check_speed`` that times plans as a ``torch.compile`` deployment runs
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
                return _rounds(runs, device, inner, seed)
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


def speed_metrics(check: SpeedCheck) -> dict[str, Any]:
    """What the policy's metrics record of the measurement (nothing when not measured)."""
    w = check.winner
    if not check.measured or w is None or w.speedup is None:
        return {}
    out: dict[str, Any] = {
        "measured_speedup": round(w.speedup, 4),
        "measured_on": f"{check.device}, batch size {check.batch_size}, {check.how}",
        "measured_spread": f"p10-p90 {w.p10:.3f}-{w.p90:.3f}x over {check.rounds} rounds",
    }
    if w.est_measured_batch is not None and check.batch_size is not None:
        out["est_speedup_at_measured_batch"] = round(w.est_measured_batch, 4)
    return out


# -- the rows of a tune ---------------------------------------------------------------------

def _uniform_errors(ev: Any, p: str, budget: float, form: str
                    ) -> tuple[float, float | None]:
    """Errors (calibration; eval data, or None) of ``default: p`` with no rules: the
    search's own score when it measured that very plan, else runs of the model. The eval
    data is run only when the calibration error is within budget (as the search does)."""
    from autoprec.apply.apply import apply_policy
    from autoprec.evaluate import score
    from autoprec.search.objective import policy_for

    if p == "fp32":
        return 0.0, None
    key = ev.space.uniform(p)
    default, layers = ev.decoder.explicit(key)
    # rules equal to their region's precision install nothing: the same plan as default p
    hit = (ev.cache.get(key) if default == p and set(layers.values()) <= {p}
           and form == ev.form else None)
    calib, evl = (None, None) if hit is None else (hit.error, hit.eval_error)
    pol = policy_for(p, {}, ev.fingerprint, ev.target, form)
    with apply_policy(ev.model, pol, fp8_backend=ev.fp8_backend):
        if calib is None:
            calib = score(ev.spec, ev.model, ev.batches, ev.ref, "(calibration)").value
        if evl is None and ev.eval_batches is not None and calib <= budget:
            evl = score(ev.spec, ev.model, ev.eval_batches, ev.eval_ref, "of eval_data").value
    return calib, evl


def _audit_errors(ev: Any, pol: Policy) -> list[str]:
    """The audit of ``pol`` on one real forward (as the search audits a feasible plan)."""
    import torch

    from autoprec.apply.apply import apply_policy
    from autoprec.fused import fused_paths_off

    batch = (ev.eval_batches or ev.batches)[0]
    with apply_policy(ev.model, pol, fp8_backend=ev.fp8_backend) as h, torch.no_grad(), \
            fused_paths_off():
        return list(h.audit(lambda: ev.spec.forward(ev.model, batch), strict=False).errors)


def baseline_rows(cost: Any, errors: Callable[[Policy], tuple[float, float | None]],
                  budget: float | None, make_policy: Callable[[str, str], Policy], *,
                  precisions: Sequence[str] | None = None, train_aware: bool = False,
                  audit: Callable[[Policy], list[str]] | None = None,
                  baselines: Sequence[tuple[str, str]] = BASELINES) -> list[Row]:
    """The one table of what a user writes instead of a tuned policy (``BASELINES``: fp32,
    one global autocast per precision, uniform tf32, ``model.to(bf16)`` / ``(fp16)``),
    used by tune's last step and by ``eval``: each row's error, estimated speed-up and
    weights on ``cost``, and whether it may be written instead of the tuned plan.

    ``errors(policy)``: (calibration-or-only error, eval-data error or None), in the
    budget's units; a RuntimeError means the model's own code refuses the plan (a row
    saying so). ``make_policy(precision, form)`` builds each baseline's policy;
    ``budget`` None: no budget known (only fp32 is then a choice); ``audit(policy)``:
    the audit's errors on a real forward; ``precisions``: what the user asked for;
    ``baselines``: the (precision, form) rows (default: ``BASELINES``).
    """
    rows = []
    for p, form in baselines:
        ok, why = cost.profile.supports(p)
        if not ok:
            rows.append(Row(label(p, form), "baseline", None,
                            why_not=f"not on {cost.profile.name}"))
            continue
        pol = make_policy(p, form)
        try:
            calib, evl = (0.0, None) if p == "fp32" else errors(pol)
        except RuntimeError as err:  # e.g. a router's own .float() meets 16-bit weights
            rows.append(Row(label(p, form), "baseline", None,
                            why_not=f"does not run on this model: {_first_line(err)}"))
            continue
        err = calib if evl is None else evl
        if budget is None:
            why = "" if p == "fp32" else "no budget recorded"
        else:
            within = calib <= budget and (evl is None or evl <= budget)
            why = "" if within else f"over budget ({err:.3g} > {budget:g})"
        if not why and p != "fp32" and audit is not None:
            found = audit(pol)
            why = f"audit: {found[0]}" if found else ""
        if not why and precisions is not None and p not in precisions:
            why = "not in --precisions"
        if not why and train_aware and p != "fp32":
            why = "not training-checked (--train-aware)"
        if not why and cost.cannot_run(pol):  # e.g. over the weight budget
            why = cost.cannot_run(pol)[0]
        row = Row(label(p, form), "baseline", pol, err, not why, cost.speedup(pol),
                  why_not=why, weight_bytes=cost.weight_bytes(pol))
        row.source = (calib, evl)
        rows.append(row)
    return rows


def tune_baseline_rows(cost: Any, ev: Any, budget: float, precisions: Sequence[str],
                       train_aware: bool = False, reference: Any = None,
                       baselines: Sequence[tuple[str, str]] = BASELINES) -> list[Row]:
    """``baseline_rows`` as tune's last step scores them: the search's own errors where it
    measured that very plan, the eval data only within budget, the audit as the search's.
    A 16-bit model (``reference`` not fp32) has its own rows (``reference_rows``)."""
    from autoprec.search.objective import policy_for

    if reference is not None and not reference.is_fp32:
        return reference_rows(cost, ev, budget, precisions, reference)
    return baseline_rows(
        cost, lambda pol: _uniform_errors(ev, pol.default, budget, pol.form), budget,
        lambda p, form: policy_for(p, {}, ev.fingerprint, ev.target, form),
        precisions=precisions, train_aware=train_aware,
        audit=lambda pol: _audit_errors(ev, pol), baselines=baselines)


def reference_rows(cost: Any, ev: Any, budget: float, precisions: Sequence[str],
                   reference: Any) -> list[Row]:
    """The baselines of a 16-bit model (``reference.ModelReference``): fp32 as the speed
    reference only (an upcast of the model, not a choice: it is not the reference and holds
    twice its weights), the model as given (error 0: it is the reference), and the deploy
    one-liners at or below the model's precision (``model.to(torch.float16)`` for a bf16
    model) other than the model itself. The training form's rows (autocast over fp32
    masters) have no fp32 masters to run over."""
    from autoprec.reference import offered
    from autoprec.search.objective import given_policy, policy_for

    name = reference.label()
    up = policy_for("fp32", {}, ev.fingerprint, ev.target, "deploy")
    rows = [Row("fp32 (model.float())", "baseline", up, None, False, cost.speedup(up),
                why_not=f"an upcast of the {name} model: the speed reference only",
                weight_bytes=cost.weight_bytes(up))]
    given = given_policy(reference, ev.fingerprint, ev.target)
    why = cost.cannot_run(given)
    err = 0.0  # exact for a uniform 16-bit model; a mixed one's fp32 rules are measured
    if reference.islands:
        from autoprec.apply.apply import apply_policy
        from autoprec.evaluate import score

        with apply_policy(ev.model, given, fp8_backend=ev.fp8_backend):
            err = score(ev.spec, ev.model, ev.batches, ev.ref, "(calibration)").value
        if not why and not err <= budget:
            why = [f"over budget ({err:.3g} > {budget:g})"]
    rows.append(Row(f"the model as given ({name})", "baseline", given, err, not why,
                    cost.speedup(given), why_not=why[0] if why else "",
                    weight_bytes=cost.weight_bytes(given)))
    rows[-1].source = (err, None)
    for p in offered(reference.default, ("bf16", "fp16")):
        if p == "fp32" or (p == reference.default and not reference.islands):
            continue
        rows.extend(tune_baseline_rows(cost, ev, budget, precisions,
                                       baselines=[(p, "deploy")]))
    return rows


def _first_line(err: BaseException) -> str:
    """An exception's first line, for a table cell."""
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:160]


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
                 device: str, target: str, at_batch: Any, *, timer: Timer | None = None,
                 seed: int = 0, force: bool = False, compile: bool = False) -> SpeedCheck:
    """Time ``rows`` on the local ``device`` with ``forward(net, batch)`` (a copy of the
    model on a GPU) and decide; ``at_batch``: the cost model at the timed batch size (the
    estimate beside each measurement, and how many forwards make one sample).
    ``compile``: each plan timed ``torch.compile``'d (``compiled_timer``)."""
    import copy

    import torch

    if device != "cpu":
        net, batch = copy.deepcopy(net).to(device), _to_device(batch, device)
    for r in rows:
        if r.policy is not None:
            r.est_measured_batch = at_batch.speedup(r.policy)
    inner = max(1, min(50, math.ceil(SAMPLE_S / max(at_batch.fp32_time, 1e-9))))

    from autoprec.fused import fused_paths_off

    def run() -> Any:  # fused torch.nn fast paths off, as in every measured forward
        with torch.no_grad(), fused_paths_off():
            return forward(net, batch)

    how = ("1 torch thread, thread CPU time" if device == "cpu" else "CUDA events") + (
        f", {inner} forwards per sample" if inner > 1 else "") + (
        ", torch.compile'd (one model copy per plan)" if compile else "")
    if timer is None:
        timer = (compiled_timer(net, forward, batch, device, target, inner=inner, seed=seed,
                                force=force) if compile else
                 interleaved_timer(net, run, device, target, inner=inner, seed=seed,
                                   force=force))
    return check_speed(rows, timer, device=device, batch_size=at_batch.batch_size, how=how)


def confirm_tune(prep: Any, space: Any, search: Any, cfg: Any, cands: Sequence[Any],
                 chosen: Any, feasible: bool, source: Any,
                 timer: Timer | None = None) -> tuple[SpeedCheck, Any, tuple[str, dict[str, str]]]:
    """tune's last step: the rows beside the chosen plan, timed where the target is local
    (compiled, for a ``--compile`` tune); returns the check, the candidate to write and its
    (default, rules)."""
    from autoprec.cost import make_cost_model
    from autoprec.search import select
    from autoprec.search.objective import policy_for

    ev = search.evaluator

    rules_of = search.decoder.rules  # recorded on the trial, else compacted (search/decode.py)

    def row(c: Any, name: str, role: str) -> Row:
        err = c.calib.error if c.eval_error is None else c.eval_error
        r = Row(name, role, policy_for(*rules_of(c), ev.fingerprint, cfg.target, ev.form), err,
                c.calib.feasible, c.calib.est_speedup, trial=c.number)
        r.source = c
        r.weight_bytes = prep.cost.weight_bytes(r.policy)
        return r

    rows = [row(chosen, "tuned", "tuned")]
    timed = source.local and cfg.measure and feasible
    if timed:
        seen = {rows[0].key}
        nxt = sorted((c for c in select.dedupe(cands) if c.calib.feasible),
                     key=lambda c: (c.calib.est_time, c.number))
        for c in nxt:
            if sum(x.role == "candidate" for x in rows) >= NEXT_CANDIDATES:
                break
            r = row(c, f"next candidate (trial {c.number})", "candidate")
            if r.key not in seen:
                seen.add(r.key)
                rows.append(r)
    rows += tune_baseline_rows(prep.cost, ev, cfg.budget, cfg.precisions, cfg.train_aware,
                               prep.reference)
    if not timed:
        check = check_speed(rows, None)
        check.reason = (source.note if not source.local else "not measured (--no-measure)"
                        if not cfg.measure else "not measured: no plan within budget")
        given = _given_if_faster(rows)
        if given is None:
            return check, chosen, rules_of(chosen)
        check.winner = given
        check.reason += (f"; {given.name} is estimated faster than the tuned plan (or the "
                         "only plan within budget): wrote it")
        return check, *_baseline_candidate(prep, space, given)

    at_measured = (source.cost_model(prep.graph, prep.calib_bs, cfg.mode)
                   if prep.cost.op_times is not None else
                   make_cost_model(prep.graph, prep.cost.profile, prep.calib_bs, cfg.mode))
    check = measure_rows(rows, prep.spec.forward, prep.net, prep.calib[0], source.device,
                         cfg.target, at_measured, timer=timer, seed=cfg.seed,
                         compile=cfg.compile)
    win = check.winner
    if win is not None and win.role != "tuned":
        check.reason += f": wrote {win.name} instead"
    if win is None or win.role == "tuned":
        return check, chosen, rules_of(chosen)
    if win.role == "candidate":
        return check, win.source, rules_of(win.source)
    return check, *_baseline_candidate(prep, space, win)


def _given_if_faster(rows: Sequence[Row]) -> Row | None:
    """A 16-bit model's own row (``reference_rows``) when the tuned plan is over budget or
    estimated slower: the written plan is never priced below the model as given."""
    tuned = rows[0]
    given = next((r for r in rows if r.role == "baseline" and r.feasible
                  and r.name.startswith("the model as given")), None)
    if given is None:
        return None
    if tuned.feasible and (tuned.est_speedup or 0.0) >= (given.est_speedup or 0.0):
        return None
    return given


def _baseline_candidate(prep: Any, space: Any, win: Row) -> tuple[Any, tuple[str, dict[str, str]]]:
    """A baseline row as the candidate to write (no trial of the study) and its rules."""
    from autoprec.search import select
    from autoprec.search.evaluation import Evaluation

    assert win.policy is not None
    p = win.policy.default
    calib, evl = win.source
    layers = dict(win.policy.layers)  # the model as given keeps its fp32 modules' rules
    pseudo = select.Candidate(number=-1, params=space.params(space.uniform(p)),
                              calib=Evaluation(calib, prep.cost.estimate(win.policy),
                                               win.est_speedup or 0.0, True, eval_error=evl),
                              policy={"default": p, "layers": layers, "form": win.policy.form})
    return pseudo, (p, layers)


__all__ = ["BASELINES", "Row", "SpeedCheck", "baseline_rows", "check_speed", "compiled_timer",
           "reference_rows", "tune_baseline_rows", "contradictions", "RETIME_MARGIN",
           "confirm_tune",
           "decide", "fill_measured", "format_rows", "interleaved_timer", "label",
           "measure_rows", "speed_metrics"]
