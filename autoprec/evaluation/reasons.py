"""What a decision records: the rules it applies (``Rule``), each reason as a small frozen
dataclass carrying the figures it was decided on, how the rows were timed (``Timing``) and
the ``Decision`` itself. Data only: ``decision`` applies the rules, ``explain.render`` puts
them into words.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from autoprec.evaluation.rows import Row


def rule_count(r: Row) -> int:
    """The rules of a row's plan (a one-liner has none)."""
    return 0 if r.policy is None else len(r.policy.layers)



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
    RECIPE_FASTER = ("a fixed training recipe (evaluation.recipes) within budget is "
                     "estimated at least as fast as the tuned plan")


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
        return cls(r.name, r.speedup, r.p10, r.p90, rule_count(r), r.weight_bytes or 0)


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


__all__ = ["ByEstimate", "ColdConfirmed", "ColdMove", "Decision", "EstimatedInstead",
           "Fallback", "MeasuredFastest", "NotMeasured", "NothingMeasured", "PageFaults",
           "Reason", "Retimed", "Rule", "SimplerTie", "Timed", "Timing", "TunedSlower",
           "WroteInstead", "rule_count"]
