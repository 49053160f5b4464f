"""The rows a tuned plan is shown beside, and the decision on them.

A ``Row`` is one plan — the tuned one, the next candidates, a baseline (what a user
writes instead: ``baselines.BASELINES``) — with its error (eval data, the budget's
units), its estimated speed-up and weight bytes on the target's cost model, and, once
timed (``timing.measure_rows``), its measured speed-up over fp32 with the p10-p90 spread.
``check_speed`` fills the timings from a timer, times a contradicted pair once more
(``contradictions``) and ``decide``s: the fastest *measured* row within budget, the
simpler plan where two overlap; a ``SpeedCheck`` is the table and the reason.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoprec.policy import Policy

#: How far the estimate may be off (issue 29 holds it to 20 %): a measured order that
#: contradicts the estimated one by more than that on both rows, and by more than the
#: noise, is timed again before anything is written (``contradictions``).
RETIME_MARGIN = 0.2


Timer = Callable[[Mapping[str, Policy]], Mapping[str, Sequence[float]]]

#: Minor page faults per forward from which the reason names a timed row: 1,000 fresh
#: 4 KiB pages (4 MB) cost ~1.7 ms on the team's AMD EPYC, where examples/wide's
#: training form faulted ~15,000 times per forward in one process (48 ms) and none in
#: another (22 ms).
FAULTS_NOTED = 1000


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
    #: the training step's memory peak (``cost.step``: a training-form row priced as a step)
    train_bytes: int | None = None
    faults: float | None = None  # measured on a CPU: minor page faults per forward (median)
    #: (speed-up, p10, p90) of the first timing where ``cold_confirm``'s slower one replaced
    #: it: the allocator state the estimate prices (no fresh pages)
    warm: tuple[float, float, float] | None = None

    @property
    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]] | None:
        """The plan's name (``decode.plan_id``: form, default and rules): rows of one key
        install the same and are timed once (why by name, not by what runs:
        ``search.decode``)."""
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
        if self.train_bytes is not None:
            out["train_memory_bytes"] = self.train_bytes
        if self.faults is not None:
            out["page_faults_per_forward"] = round(self.faults, 1)
        if self.warm is not None:
            out["measured_before_cold_confirm"] = num(self.warm[0])
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
    train = any(r.get("train_memory_bytes") is not None for r in check["rows"])
    head = ("plan", "error", "est. speed-up", "measured (p10-p90)", "weights",
            *(("train memory",) if train else ()), "within budget")
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
        tb = r.get("train_memory_bytes")
        mem = (("-" if tb is None else f"{tb / 1e6:.1f} MB",) if train else ())
        cells.append((name, err, est, meas, weights, *mem, ok))
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
        faults = getattr(samples, "faults", {}).get(r.same_as or r.name)
        if faults:
            r.faults = float(np.median(faults))


def fault_note(rows: Sequence[Row]) -> str:
    """What the reason says of timed rows that page-faulted on fresh memory in every
    forward (``FAULTS_NOTED`` or more per forward, median): their time includes the
    allocator's state in this process, which another process may not share."""
    hit = [r for r in rows if r.same_as is None and r.faults is not None
           and r.faults >= FAULTS_NOTED]
    if not hit:
        return ""
    each = ", ".join(f"{r.name} {r.faults:,.0f}" for r in hit)
    return (f" [page faults per forward: {each}. These forwards touch memory the allocator "
            "got fresh from the OS (glibc returns large freed buffers, such as per-call "
            "weight casts); another process, or another allocator, may run them without "
            "the faults]")


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
                batch_size: int | None = None, how: str = "",
                cold_timer: Timer | None = None) -> SpeedCheck:
    """Time the runnable rows with ``timer`` (one entry per distinct plan) and decide; with
    no timer (a remote target) the rows keep their estimates and the tuned row stands.
    ``cold_timer``: the same timing with the allocator trimmed before every forward, for
    a winner that allocates per call (``cold_confirm``)."""
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
    timed = timer(plans)  # measure_interleaved's Samples carry page faults per forward
    samples = dict(timed)
    fill_measured(rows, timed)
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
    cold = cold_confirm(rows, winner, cold_timer)
    if cold:
        winner, reason = decide(rows)
    n = min((len(v) for v in samples.values()), default=0)
    return SpeedCheck(rows, winner, reason + note + cold + fault_note(rows), device,
                      batch_size, how, n, retimed=again)


def _casts_per_call(policy: Policy) -> bool:
    """The training form with a 16-bit or narrower rule: it casts weights on every call."""
    return policy.form == "train" and any(
        p not in ("fp32", "tf32") for p in (policy.default, *policy.layers.values()))


def cold_confirm(rows: Sequence[Row], winner: Row | None, cold_timer: Timer | None) -> str:
    """Before a plan that casts its weights on every call is written, time it, fp32 and
    the next two fastest rows again with the allocator trimmed before every forward, and
    keep each row's slower state; the caller decides again. Returns what the reason says.

    Why: the per-call casts allocate fresh buffers every forward, and whether glibc serves
    them from fresh, faulting pages depends on what the process allocated before
    (benchmarks/results/page_faults.md: examples/wide's global bf16 autocast ran 2.44x of fp32
    with freed memory kept, 1.08x with ~14,500 faults per forward). A plan measured in the
    lucky state alone must not be written: issue 29's tune wrote an autocast plan it
    measured at 1.43x where ``eval --measure`` measured 0.79x."""
    if (cold_timer is None or winner is None or winner.policy is None
            or not _casts_per_call(winner.policy)):
        return ""
    base = next(r for r in rows if r.role == "baseline" and r.policy is not None
                and r.policy.default == "fp32" and not r.policy.layers)
    timed = sorted((r for r in rows if r.same_as is None and r.speedup is not None
                    and r.policy is not None and r.feasible),
                   key=lambda r: -(r.speedup or 0.0))
    names = list(dict.fromkeys([base.same_as or base.name, winner.same_as or winner.name,
                                *(r.name for r in timed[:3])]))
    plans = {r.name: r.policy for r in rows if r.name in names and r.policy is not None}
    got = cold_timer(plans)
    shadow = [copy.copy(r) for r in rows if (r.same_as or r.name) in names]
    fill_measured(shadow, got)
    moved = []
    for r, c in zip((r for r in rows if (r.same_as or r.name) in names), shadow, strict=True):
        if c.speedup is not None and r.speedup is not None and c.speedup < r.speedup:
            if r.same_as is None and r is not base:
                moved.append(f"{r.name} {r.speedup:.2f}x -> {c.speedup:.2f}x"
                             + (f" ({c.faults:,.0f} faults per forward)" if c.faults else ""))
            r.warm = (r.speedup, r.p10 or r.speedup, r.p90 or r.speedup)
            r.speedup, r.p10, r.p90, r.faults = c.speedup, c.p10, c.p90, c.faults
    return (f" [{winner.name} casts its weights on every call: {', '.join(names)} timed "
            "again with the allocator trimmed before each forward (fresh pages: "
            "benchmarks/results/page_faults.md); each row keeps its slower state"
            + (f": {'; '.join(moved)}]" if moved else ": none slower]"))


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


__all__ = ["FAULTS_NOTED", "RETIME_MARGIN", "Row", "SpeedCheck", "Timer", "check_speed", "contradictions", "cold_confirm", "decide", "fault_note", "fill_measured", "format_rows", "label", "speed_metrics"]
