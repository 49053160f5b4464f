"""Which plan is written, and why: one function, ``decide``, returning data.

The rows (``rows.Row``: the tuned plan, the next candidates, the baselines) arrive priced,
and timed where the target is this machine (``timing.measure_rows``, described by a
``Timing``). ``decide`` applies the rules in one place and returns a ``Decision``: the
winner, the runner-up and the reasons, each a small frozen dataclass naming its rule
(``Rule``) and carrying the figures it was decided on (``reasons``: the data, re-exported
here). ``explain.render`` puts them into words; nothing here formats text.

The rules, in the order they apply:

1. **by estimate** (``ByEstimate``): the search's pick, the fastest plan within budget by
   the cost model (``by_estimate``; the closest one, ``closeness``, when none is within
   budget).
2. **not timed** (``NotMeasured``): where the target is not this machine, or timing was
   not asked for, the estimates stand. A tune then writes, instead of the tuned plan
   (``EstimatedInstead``), the model as given when it is a 16-bit model estimated faster
   than the plan (``Fallback.GIVEN_FASTER``), or the fastest baseline within budget when
   the tuned plan is not within budget (``Fallback.BASELINE_WITHIN_BUDGET``), or, for a
   training tune, a one-liner that passed the short run and is estimated as fast
   (``Fallback.CHECKED_ONE_LINER``).
3. **timed** (``fastest_measured``): the fastest *measured* row within budget
   (``MeasuredFastest``), unless a simpler one (fewer rules, then fewer weight bytes) is
   as fast within the noise — their p10-p90 ranges overlap (``SimplerTie``); a tuned plan
   measured slower than another row is never the choice (``TunedSlower``). A measured
   order the estimate contradicts beyond both their errors (``contradictions``) was timed
   again first (``Retimed``); a winner that casts its weights on every call was timed
   again with a trimmed allocator, each row keeping its slower state (``ColdConfirmed``);
   rows that page-faulted in every forward are named (``PageFaults``). A tune that writes
   another row than its tuned plan says so (``WroteInstead``).

Before the decision, the rules that make the rows it is given (each over plain rows or a
study's candidates; tune's ``confirm`` builds the rows and calls them, ``write`` writes):

- **eligibility**: a baseline below ``--min-speedup`` (``demote_below_min_speedup``) or
  stored 16-bit under ``--form train`` (``demote_stored_under_train``) is not feasible; with
  no trial within budget the baselines may be written instead (``baselines_instead``);
- **what is timed**: the next ``NEXT_CANDIDATES`` feasible candidates beside the chosen
  plan (``next_candidates``), not the training-form one-liners estimated below
  ``SLOW_TO_TIME`` of fp32 (``rows_to_time``);
- **a training tune** (``--train-aware``): candidates are checked in ``training_tries``'
  order, at most ``MAX_TRIES`` (``first_that_trains``), and a one-liner is not trained
  where it could not be written (``not_worth_training``);
- **the timing step's second look**: a winner that casts per call (``casts_per_call``) is
  timed again cold with ``cold_rows``, each keeping its slower timing (``keep_slower``);
- **the pick** a user is told (``recommend``), and one tolerance for "as fast"
  (``SAME_SPEED``: ``as_fast``, ``same_speed``).

tests/evaluation/test_decision.py holds each rule as a table of cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from autoprec.evaluation.reasons import (
    ByEstimate,
    ColdConfirmed,
    ColdMove,
    Decision,
    EstimatedInstead,
    Fallback,
    MeasuredFastest,
    NothingMeasured,
    NotMeasured,
    PageFaults,
    Reason,
    Retimed,
    Rule,
    SimplerTie,
    Timed,
    Timing,
    TunedSlower,
    WroteInstead,
)
from autoprec.evaluation.reasons import rule_count as _rules
from autoprec.evaluation.rows import FAULTS_NOTED, Row

#: How far the estimate may be off (issue 29 holds it to 20 %): a measured order that
#: contradicts the estimated one by more than that on both rows, and by more than the
#: noise, is timed again before anything is written (``contradictions``).
RETIME_MARGIN = 0.2

#: Estimates this close (relative) read as "as fast": the one tolerance of every rule that
#: compares two estimates (``as_fast``, ``same_speed``).
SAME_SPEED = 0.005

#: Candidates from the study timed after the chosen one (the next fastest feasible ones).
NEXT_CANDIDATES = 2

#: A training-form one-liner estimated below this share of fp32's speed is not timed: fp32
#: is timed beside it and within budget, so it could be written only by measuring more than
#: twice its estimate (where the target is here the estimate is priced from this machine's
#: own op timings). A 16-bit GEMM the CPU has no kernel for is where this binds: one global
#: fp16 autocast on an AVX512-BF16 EPYC, estimated 0.35x, times at 0.08x, and each of its
#: timed steps costs twelve fp32 steps.
SLOW_TO_TIME = 0.5

#: Candidates the short run checks (``--train-aware``) before the tuned row is declared
#: infeasible.
MAX_TRIES = 3

#: Why a stored-weights (deploy-form) row cannot be written by a training tune.
NO_MASTERS = "--form train: it stores no fp32 masters"


def as_fast(a: float, b: float) -> bool:
    """Estimate ``a`` is at least ``b``'s, within ``SAME_SPEED`` (``b`` no more than
    ``SAME_SPEED`` above it)."""
    return not b > a * (1 + SAME_SPEED)


def same_speed(a: float, b: float) -> bool:
    """Estimates ``a`` and ``b`` within ``SAME_SPEED`` of ``b`` either way (what a person
    reads as "the same speed")."""
    return abs(a - b) <= SAME_SPEED * b


# -- rule 1: the search's pick, by estimate --------------------------------------------

class Scored(Protocol):
    """A candidate of the study (``search.select.Candidate``): its trial and its scores
    (``calib``: ``search.plan_score.PlanScore``)."""

    number: int
    calib: Any


C = TypeVar("C", bound=Scored)


def closeness(ev: Any, budget: float, min_speedup: float | None) -> float:
    """How far a plan's scores (``PlanScore``) are from feasible (0 = feasible): relative
    budget overshoot + speed shortfall."""
    err = ev.error if ev.eval_error is None else max(ev.error, ev.eval_error)
    over = 0.0 if err <= budget else (err - budget) / max(budget, 1e-12)
    if not math.isfinite(over):
        over = 1e30
    short = 0.0
    if min_speedup is not None and ev.est_speedup < min_speedup:
        short = (min_speedup - ev.est_speedup) / min_speedup
    return over + short


def by_estimate(cands: Sequence[C], *, budget: float, min_speedup: float | None
                ) -> tuple[C, bool]:
    """Rule 1 on distinct plans (``search.select.dedupe``): the fastest feasible candidate
    by estimate (then the smaller error, the earlier trial); else (the closest candidate,
    False)."""
    if not cands:
        raise ValueError("no completed trials to choose from")
    feasible = [c for c in cands if c.calib.feasible]
    if feasible:
        return min(feasible, key=lambda c: (c.calib.est_time, c.calib.error, c.number)), True
    closest = min(cands, key=lambda c: (closeness(c.calib, budget, min_speedup),
                                        c.calib.est_time, c.number))
    return closest, False


# -- which rows may be written, tried, timed ----------------------------------------------

def demote_below_min_speedup(rows: Iterable[Row], min_speedup: float | None) -> None:
    """The speed target binds on a baseline as on a trial: a row within budget estimated
    below ``--min-speedup`` is not feasible, and says why."""
    if min_speedup is None:
        return
    for r in rows:
        if r.feasible and (r.est_speedup or 0.0) < min_speedup:
            r.feasible, r.why_not = False, f"below --min-speedup {min_speedup:g}"


def demote_stored_under_train(rows: Iterable[Row], form: str) -> None:
    """A tune asked for fp32 masters (``--form train``): a stored 16-bit (deploy-form) row
    cannot train, so it is not feasible (``NO_MASTERS``)."""
    if form != "train":
        return
    for r in rows:
        if r.feasible and r.policy is not None and r.policy.form == "deploy":
            r.feasible, r.why_not = False, NO_MASTERS


def baselines_instead(tuned_feasible: bool, baselines: Sequence[Row]) -> bool:
    """No trial within budget, a baseline is: the baselines are what may be written (timed
    where the target is here), never the closest over-budget plan."""
    return not tuned_feasible and any(r.feasible and r.policy is not None for r in baselines)


def next_candidates(rows: Iterable[Row], taken: set[Any],
                    trains: Callable[[Row], bool] | None = None,
                    n: int = NEXT_CANDIDATES) -> list[Row]:
    """The next candidates timed beside the chosen plan: from ``rows`` (the feasible
    candidates' rows, fastest estimate first), the first ``n`` plans not in ``taken`` (row
    keys; the ones added are added to it) — for a training tune only those that passed the
    short run (``trains``)."""
    out: list[Row] = []
    more = iter(rows)  # a row is made only when one more is wanted
    while len(out) < n and (r := next(more, None)) is not None:
        if r.key in taken or (trains is not None and not trains(r)):
            continue
        taken.add(r.key)
        out.append(r)
    return out


def rows_to_time(rows: list[Row]) -> list[Row]:
    """The rows worth timing: all but the training-form one-liners (other than fp32)
    estimated below ``SLOW_TO_TIME`` x fp32's speed; such a row is not written either, and
    says why."""
    keep = []
    for r in rows:
        pol = r.policy
        slow = (r.role == "baseline" and pol is not None and pol.form == "train"
                and not (pol.default == "fp32" and not pol.layers)
                and r.est_speedup is not None and r.est_speedup < SLOW_TO_TIME)
        if not slow:
            keep.append(r)
            continue
        if r.feasible:
            r.feasible = False
            r.why_not = (f"not timed: estimated {r.est_speedup:.2f}x, under "
                         f"{SLOW_TO_TIME:g}x of fp32's speed here")
    return keep


# -- a training tune's choice (--train-aware: the short run) ----------------------------

def training_tries(chosen: C, cands: Sequence[C]) -> list[C]:
    """The order a training tune checks candidates in (distinct plans,
    ``search.select.dedupe``): the chosen one, then the other feasible ones, fastest
    estimate first."""
    return [chosen] + sorted((c for c in cands if c.calib.feasible and c is not chosen),
                             key=lambda c: (c.calib.est_time, c.number))


def first_that_trains(tries: Iterable[tuple[Any, Row]], verdict: Callable[[Row], str]
                      ) -> tuple[Any, Row] | None:
    """(candidate, row): the first of ``tries`` whose row passes the short run
    (``verdict``: '' when it does, else why not), at most ``MAX_TRIES`` distinct plans
    checked; None when none does — then the first row is marked infeasible with the first
    failure's reason."""
    seen: set[Any] = set()
    failed: list[str] = []
    first: Row | None = None
    for c, r in tries:
        first = r if first is None else first
        if r.key in seen:
            continue
        seen.add(r.key)
        why = verdict(r)
        if not why:
            return c, r
        failed.append(why)
        if len(seen) >= MAX_TRIES:
            break
    if first is not None:
        first.feasible = False
        first.why_not = failed[0] if failed else "short run: not checked"
    return None


def not_worth_training(form: str, est: float | None, bar: float | None) -> str:
    """Why a one-liner is not given the short run ('' when it is): a stored-weights row
    cannot train (``NO_MASTERS``); where the rows are not timed, one estimated slower than
    the tuned plan that passed (``bar``) by more than ``SAME_SPEED`` cannot be written
    (``one_liner_instead``), so it is not trained."""
    if form == "deploy":
        return NO_MASTERS
    if bar is not None and est is not None and not as_fast(est, bar):
        return (f"not training-checked: estimated {est:.2f}x, slower than the tuned "
                f"plan's {bar:.2f}x, which trains within the gap")
    return ""


def _overlap(a: Row, b: Row) -> bool:
    """The two rows' p10-p90 ranges of per-round speed-ups overlap: as fast within the
    noise of this measurement."""
    if None in (a.p10, a.p90, b.p10, b.p90):
        return a.speedup == b.speedup
    return bool(a.p10 <= b.p90 and b.p10 <= a.p90)


def fastest_measured(rows: Sequence[Row]) -> tuple[Row | None, Reason, Row | None]:
    """Rule 3 on timed rows: (the winner, its reason, the runner-up). The fastest measured
    row within budget, unless a simpler one (fewer rules: a one-liner has none) is as fast
    within the noise — then the simplest of those (among equals the one holding fewer
    weight bytes, then the faster median). A tuned plan measured slower than a baseline or
    another candidate is never the choice; the earlier row keeps an exact tie."""
    timed = [r for r in rows if r.feasible and r.speedup is not None]
    if not timed:
        return None, NothingMeasured(), None
    fastest = timed[0]
    for r in timed[1:]:
        if r.speedup > fastest.speedup:  # strict: the earlier row (the tuned plan) keeps ties
            fastest = r
    ties = [r for r in timed if _overlap(r, fastest)]
    best = min(ties, key=lambda r: (_rules(r), r.weight_bytes or 0, -(r.speedup or 0.0),
                                    timed.index(r)))
    if best is not fastest and (_rules(best), best.weight_bytes or 0) < (
            _rules(fastest), fastest.weight_bytes or 0):
        return best, SimplerTie(Timed.of(best), Timed.of(fastest)), fastest
    best = fastest
    tuned = next((r for r in rows if r.role == "tuned"), None)
    plan = best.same_as or best.name  # rows of the same plan are not a runner-up
    others = sorted((r for r in timed if (r.same_as or r.name) != plan),
                    key=lambda r: -(r.speedup or 0))
    runner = others[0] if others else None
    if tuned is None or best is tuned:
        return best, MeasuredFastest(Timed.of(best), None if runner is None
                                     else Timed.of(runner)), runner
    overlap = not (tuned.p90 is None or best.p10 is None or tuned.p90 < best.p10)
    return best, TunedSlower(Timed.of(tuned), tuned.est_speedup, tuned.feasible,
                             tuned.why_not, Timed.of(best), overlap), runner


def contradictions(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """Pairs (a, b) of distinct timed plans where a measured faster than b beyond the noise
    (a's p10 above b's p90) while the estimate at the timed batch has b faster, and that
    flip is more than the estimate's error: a's estimate more than ``RETIME_MARGIN`` below
    a's p10, or b's more than it above b's p90 (the timing step times them again). (The
    issue's run that wrote a plan slower than fp32: one global bf16 autocast measured
    1.43x, p10 1.22x, estimated ~0.85x.)"""
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


def fp32_row(rows: Sequence[Row]) -> Row:
    """The all-fp32 baseline row (every timing's reference)."""
    return next(r for r in rows if r.role == "baseline" and r.policy is not None
                and r.policy.default == "fp32" and not r.policy.layers)


def casts_per_call(policy: Any) -> bool:
    """The training form with a 16-bit or narrower rule: it casts weights on every call, so
    a winner of this kind is timed again cold (``timing.cold_confirm``)."""
    return policy.form == "train" and any(
        p not in ("fp32", "tf32") for p in (policy.default, *policy.layers.values()))


def cold_rows(rows: Sequence[Row], winner: Row) -> list[str]:
    """The rows timed again cold beside a winner that casts per call: fp32, the winner and
    the three fastest timed rows within budget (distinct plans)."""
    base = fp32_row(rows)
    timed = sorted((r for r in rows if r.same_as is None and r.speedup is not None
                    and r.policy is not None and r.feasible),
                   key=lambda r: -(r.speedup or 0.0))
    return list(dict.fromkeys([base.same_as or base.name, winner.same_as or winner.name,
                               *(r.name for r in timed[:3])]))


def keep_slower(rows: Sequence[Row], cold: Sequence[Row], names: Sequence[str]
                ) -> tuple[ColdMove, ...]:
    """Each row of ``names`` keeps the slower of its two timings (``cold``: its copies,
    timed with the allocator trimmed, in ``rows``' order); the first timing is kept in
    ``Row.warm``. Returns the rows (other than fp32's) that moved."""
    base = fp32_row(rows)
    moved = []
    for r, c in zip((r for r in rows if (r.same_as or r.name) in names), cold, strict=True):
        if c.speedup is not None and r.speedup is not None and c.speedup < r.speedup:
            if r.same_as is None and r is not base:
                moved.append(ColdMove(r.name, r.speedup, c.speedup, c.faults))
            r.warm = (r.speedup, r.p10 or r.speedup, r.p90 or r.speedup)
            r.speedup, r.p10, r.p90, r.faults = c.speedup, c.p10, c.p90, c.faults
    return tuple(moved)


def page_faults(rows: Sequence[Row]) -> PageFaults | None:
    """Timed rows that page-faulted on fresh memory in every forward (``FAULTS_NOTED`` or
    more per forward, median): their time includes the allocator's state in this process,
    which another process may not share."""
    hit = tuple((r.name, r.faults) for r in rows if r.same_as is None
                and r.faults is not None and r.faults >= FAULTS_NOTED)
    return PageFaults(hit) if hit else None


def _given_if_faster(rows: Sequence[Row]) -> Row | None:
    """A 16-bit model's own row when the tuned plan is over budget or estimated slower: the
    written plan is never priced below the model as given."""
    tuned = rows[0]
    given = next((r for r in rows if r.role == "baseline" and r.feasible
                  and r.name.startswith("the model as given")), None)
    if given is None:
        return None
    if tuned.feasible and (tuned.est_speedup or 0.0) >= (given.est_speedup or 0.0):
        return None
    return given


def _best_baseline_if_infeasible(rows: Sequence[Row]) -> Row | None:
    """The fastest baseline within budget (by estimate; the simpler among equals) when the
    tuned plan is not within budget: a one-liner that meets the budget is written rather
    than the closest over-budget plan."""
    if rows[0].feasible:
        return None
    ok = [r for r in rows if r.role == "baseline" and r.feasible and r.policy is not None
          and r.est_speedup is not None]
    if not ok:
        return None
    return max(ok, key=lambda r: (r.est_speedup or 0.0, -len(r.policy.layers),
                                  -(r.weight_bytes or 0)))


def _fastest_writable(rows: Sequence[Row], role: str) -> Row | None:
    """The fastest-estimated row of ``role`` that may be written (within budget, a policy,
    an estimate); of equal estimates the one with fewer rules. None when there is none."""
    ok = [r for r in rows if r.role == role and r.feasible and r.policy is not None
          and r.est_speedup is not None]
    return max(ok, key=lambda r: (r.est_speedup or 0.0, -len(r.policy.layers)), default=None)


def one_liner_instead(rows: Sequence[Row]) -> Row | None:
    """Unmeasured rows of a training tune (``--train-aware``): the fastest checked one-liner
    (a baseline row within budget, which passed the short run) whose estimate is at least
    the tuned row's (within ``SAME_SPEED``); None when the tuned row is faster or there is
    none. A plan is never written over a faster checked one-liner."""
    tuned, best = rows[0], _fastest_writable(rows, "baseline")
    if best is None:
        return None
    if tuned.feasible and not as_fast(best.est_speedup or 0.0, tuned.est_speedup or 0.0):
        return None
    return best


def recipe_instead(rows: Sequence[Row]) -> Row | None:
    """Unmeasured rows of a training tune: the fastest fixed recipe that may be written
    (role "recipe": within budget, and trained within the gap where checked) when the tuned
    row does not beat it — it is not within budget, or not estimated faster; None when it
    does, or a baseline that may be written is estimated faster than that recipe (the
    other rules then apply). The tuned plan is written only where it beats the recipes."""
    tuned, best = rows[0], _fastest_writable(rows, "recipe")
    if best is None:
        return None
    if tuned.feasible and (tuned.est_speedup or 0.0) > (best.est_speedup or 0.0):
        return None
    if any(r.role == "baseline" and r.feasible and r.policy is not None
           and (r.est_speedup or 0.0) > (best.est_speedup or 0.0) for r in rows):
        return None
    return best


def speed_of(r: Row, measured: bool) -> float:
    """A row's speed-up as a pick reads it: measured where timed, else estimated
    (-inf: neither)."""
    v = r.speedup if measured and r.speedup is not None else r.est_speedup
    return -math.inf if v is None else v


def recommend(rows: Sequence[Row], winner: Row | None, measured: bool) -> Row | None:
    """The row a user should pick (tune's and eval's ``pick:``): the decision's winner
    where it is within budget (an estimate tie goes to what was written), else the fastest
    row within budget (``speed_of``); None: nothing within budget."""
    ok = [r for r in rows if r.feasible and r.policy is not None]
    if not ok:
        return None
    if winner is not None and winner in ok:
        return winner
    return max(ok, key=lambda r: speed_of(r, measured))


def _runner_up_by_estimate(rows: Sequence[Row], winner: Row | None) -> Row | None:
    """The fastest other plan within budget by estimate."""
    key = None if winner is None else winner.key
    ok = [r for r in rows if r.feasible and r.policy is not None and r.est_speedup is not None
          and r is not winner and (key is None or r.key != key)]
    return max(ok, key=lambda r: r.est_speedup or 0.0, default=None)


def decide(rows: Sequence[Row], timing: Timing, *, estimate: ByEstimate | None = None,
           writes: bool = True, trains: bool = False) -> Decision:
    """The one decision on ``rows`` (the tuned row first) as ``timing`` left them.

    ``estimate``: the search's pick (rule 1), recorded first. Not timed (rule 2): the tuned
    row stands, or, for a run that ``writes`` (tune), the model as given or a baseline
    within budget by estimate, or (``trains``: ``--train-aware``, the baselines' short runs
    checked) a checked one-liner estimated as fast; a run that writes nothing (eval) has
    no winner then. Timed
    (rule 3): ``fastest_measured``, with the timing step's second looks and the page
    faults as further reasons, and, for a run that writes, ``WroteInstead`` when the
    winner is not the tuned row.
    """
    reasons: list[Reason] = [] if estimate is None else [estimate]
    if not timing.measured:
        reasons.append(NotMeasured(timing.note))
        if not writes:
            return Decision(None, None, tuple(reasons))
        winner = next((r for r in rows if r.role == "tuned"), None)
        fallback, instead = None, None
        for kind, rule in ((Fallback.GIVEN_FASTER, _given_if_faster),
                           (Fallback.RECIPE_FASTER, recipe_instead),
                           (Fallback.BASELINE_WITHIN_BUDGET, _best_baseline_if_infeasible),
                           (Fallback.CHECKED_ONE_LINER, one_liner_instead if trains else None)):
            if rule is not None and rows and (instead := rule(rows)) is not None:
                fallback = kind
                break
        if instead is not None and fallback is not None:
            winner = instead
            reasons.append(EstimatedInstead(instead.name, fallback))
        return Decision(winner, _runner_up_by_estimate(rows, winner), tuple(reasons))
    winner, why, runner = fastest_measured(rows)
    reasons.append(why)
    reasons += [r for r in (timing.retimed, timing.cold, page_faults(rows)) if r is not None]
    if writes and winner is not None and winner.role != "tuned":
        reasons.append(WroteInstead(winner.name))
    return Decision(winner, runner, tuple(reasons))


__all__ = ["MAX_TRIES", "NEXT_CANDIDATES", "NO_MASTERS", "RETIME_MARGIN", "SAME_SPEED", "SLOW_TO_TIME", "ByEstimate", "ColdConfirmed", "ColdMove", "Decision", "EstimatedInstead", "Fallback", "MeasuredFastest", "NotMeasured", "NothingMeasured", "PageFaults", "Reason", "Retimed", "Rule", "Scored", "SimplerTie", "Timed", "Timing", "TunedSlower", "WroteInstead", "as_fast", "baselines_instead", "by_estimate", "casts_per_call", "closeness", "cold_rows", "contradictions", "decide", "demote_below_min_speedup", "demote_stored_under_train", "fastest_measured", "first_that_trains", "fp32_row", "keep_slower", "next_candidates", "not_worth_training", "one_liner_instead", "page_faults", "recipe_instead", "recommend", "rows_to_time", "same_speed", "speed_of", "training_tries"]
