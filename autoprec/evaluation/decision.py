"""Which plan is written, and why: one function, ``decide``, returning data.

The rows (``rows.Row``: the tuned plan, the next candidates, the baselines) arrive priced,
and timed where the target is this machine (``timing.measure_rows``, described by a
``Timing``). ``decide`` applies the rules in one place and returns a ``Decision``: the
winner, the runner-up and the reasons, each a small frozen dataclass naming its rule
(``Rule``) and carrying the figures it was decided on. ``explain.render`` puts them into
words; nothing here formats text.

The rules, in the order they apply:

1. **by estimate** (``ByEstimate``): the search's pick, the fastest plan within budget by
   the cost model (``search.select.choose``; the closest one when none is within budget).
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
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from autoprec.evaluation.rows import FAULTS_NOTED, Row

#: How far the estimate may be off (issue 29 holds it to 20 %): a measured order that
#: contradicts the estimated one by more than that on both rows, and by more than the
#: noise, is timed again before anything is written (``contradictions``).
RETIME_MARGIN = 0.2

#: Estimates this close (relative) read as "as fast" (``one_liner_instead``).
SAME_SPEED = 0.005


class Rule(enum.Enum):
    """The rule a reason records."""

    BY_ESTIMATE = "fastest within budget by estimate"
    NOT_MEASURED = "not timed: the estimates stand"
    ESTIMATED_INSTEAD = "another row written by estimate"
    NOTHING_MEASURED = "nothing within budget was timed"
    MEASURED_FASTEST = "fastest measured within budget"
    SIMPLER_TIE = "a simpler plan as fast within the noise"
    TUNED_SLOWER = "the tuned plan measured slower"
    RETIMED = "timed again: the measurement contradicted the estimate"
    COLD_CONFIRMED = "timed again with the allocator trimmed"
    PAGE_FAULTS = "rows that page-faulted in every forward"
    WROTE_INSTEAD = "another row than the tuned plan is written"


class Fallback(enum.Enum):
    """Why a tune that timed nothing writes another row than its tuned plan."""

    GIVEN_FASTER = "the model as given is estimated faster than the tuned plan"
    BASELINE_WITHIN_BUDGET = "the tuned plan is over budget; a baseline is within it"
    CHECKED_ONE_LINER = "a one-liner that trains like fp32 is estimated as fast (--train-aware)"


@dataclass(frozen=True)
class Reason:
    """One reason of a decision; ``rule`` names it."""

    rule: ClassVar[Rule]


@dataclass(frozen=True)
class ByEstimate(Reason):
    rule: ClassVar[Rule] = Rule.BY_ESTIMATE
    trial: int  # the study's trial (-1: the model as given, no trial)
    est_speedup: float
    feasible: bool  # False: nothing was within budget, this is the closest plan


@dataclass(frozen=True)
class NotMeasured(Reason):
    rule: ClassVar[Rule] = Rule.NOT_MEASURED
    note: str  # why not: the speed source's note, or the option that turned timing off


@dataclass(frozen=True)
class EstimatedInstead(Reason):
    rule: ClassVar[Rule] = Rule.ESTIMATED_INSTEAD
    row: str
    fallback: Fallback


@dataclass(frozen=True)
class NothingMeasured(Reason):
    rule: ClassVar[Rule] = Rule.NOTHING_MEASURED


@dataclass(frozen=True)
class Timed:
    """A row's measured speed-up over fp32 and its p10-p90 spread."""

    name: str
    speedup: float | None
    p10: float | None
    p90: float | None
    rules: int = 0
    weight_bytes: int = 0

    @classmethod
    def of(cls, r: Row) -> Timed:
        return cls(r.name, r.speedup, r.p10, r.p90, _rules(r), r.weight_bytes or 0)


@dataclass(frozen=True)
class MeasuredFastest(Reason):
    rule: ClassVar[Rule] = Rule.MEASURED_FASTEST
    winner: Timed
    runner_up: Timed | None  # the next fastest other plan


@dataclass(frozen=True)
class SimplerTie(Reason):
    rule: ClassVar[Rule] = Rule.SIMPLER_TIE
    winner: Timed
    fastest: Timed  # the faster median, with more rules (or as many and more weights)


@dataclass(frozen=True)
class TunedSlower(Reason):
    rule: ClassVar[Rule] = Rule.TUNED_SLOWER
    tuned: Timed
    tuned_est: float | None
    tuned_feasible: bool
    tuned_why_not: str  # why it could not be timed (when ``tuned.speedup`` is None)
    winner: Timed
    overlap: bool  # their p10-p90 ranges overlap: the faster median is kept


@dataclass(frozen=True)
class Retimed(Reason):
    rule: ClassVar[Rule] = Rule.RETIMED
    rows: tuple[str, ...]  # the rows timed again (fp32 besides)
    faster: str  # measured faster at first, estimated slower
    faster_first: float
    faster_est: float
    slower: str
    slower_first: float
    slower_est: float
    still: bool  # the second timing contradicts the estimate too: the measurement stands


@dataclass(frozen=True)
class ColdMove:
    """A row the cold timing measured slower than the first: it keeps the slower state."""

    name: str
    warm: float
    cold: float
    faults: float | None


@dataclass(frozen=True)
class ColdConfirmed(Reason):
    rule: ClassVar[Rule] = Rule.COLD_CONFIRMED
    winner: str  # the preliminary winner, which casts its weights on every call
    rows: tuple[str, ...]  # timed again
    moved: tuple[ColdMove, ...]


@dataclass(frozen=True)
class PageFaults(Reason):
    rule: ClassVar[Rule] = Rule.PAGE_FAULTS
    rows: tuple[tuple[str, float], ...]  # (row, minor page faults per forward)


@dataclass(frozen=True)
class WroteInstead(Reason):
    rule: ClassVar[Rule] = Rule.WROTE_INSTEAD
    row: str


@dataclass(frozen=True)
class Timing:
    """How the rows were timed (or why not): the measurement's facts beside the rows'
    own figures, and the timing step's second looks (``Retimed``, ``ColdConfirmed``)."""

    device: str | None = None  # where the rows were timed; None: not timed
    batch_size: int | None = None
    how: str = ""  # clock, threads, forwards per sample
    rounds: int = 0
    note: str = ""  # why not timed
    retimed: Retimed | None = None
    cold: ColdConfirmed | None = None

    @property
    def measured(self) -> bool:
        return self.device is not None


@dataclass(frozen=True)
class Decision:
    """The row to write (None: nothing, e.g. eval, or nothing timed within budget), the
    runner-up, and why."""

    winner: Row | None
    runner_up: Row | None
    reasons: tuple[Reason, ...]

    def reason(self, rule: Rule) -> Reason | None:
        """The reason recording ``rule``, if any."""
        return next((r for r in self.reasons if r.rule is rule), None)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(r.rule for r in self.reasons)


def _rules(r: Row) -> int:
    return 0 if r.policy is None else len(r.policy.layers)


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


def one_liner_instead(rows: Sequence[Row]) -> Row | None:
    """Unmeasured rows of a training tune (``--train-aware``): the fastest checked one-liner
    (a baseline row within budget, which passed the short run) whose estimate is at least
    the tuned row's (within ``SAME_SPEED``); None when the tuned row is faster or there is
    none. A plan is never written over a faster checked one-liner."""
    tuned = rows[0]
    ok = [r for r in rows if r.role == "baseline" and r.feasible and r.policy is not None
          and r.est_speedup is not None]
    if not ok:
        return None
    best = max(ok, key=lambda r: (r.est_speedup or 0.0, -len(r.policy.layers)))
    if tuned.feasible and (tuned.est_speedup or 0.0) > (best.est_speedup or 0.0) * (
            1 + SAME_SPEED):
        return None
    return best


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


__all__ = ["RETIME_MARGIN", "SAME_SPEED", "ByEstimate", "ColdConfirmed", "ColdMove", "Decision",
           "EstimatedInstead", "Fallback", "MeasuredFastest", "NotMeasured", "NothingMeasured",
           "PageFaults", "Reason", "Retimed", "Rule", "SimplerTie", "Timed", "Timing",
           "TunedSlower", "WroteInstead", "contradictions", "decide", "fastest_measured",
           "one_liner_instead", "page_faults"]
