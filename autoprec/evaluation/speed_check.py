"""The rows beside a plan with the decision on them: what tune and eval show and record.

A ``SpeedCheck`` holds the rows (``rows.Row``), how they were timed (``decision.Timing``)
and the ``decision.Decision``; its ``reason`` is the decision in words
(``explain.render``) and ``to_dict`` the JSON ``baselines`` object of tune and eval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoprec.evaluation.decision import Decision, Rule, Timing, recommend, speed_of
from autoprec.evaluation.explain import render
from autoprec.evaluation.rows import Row, format_rows


@dataclass
class SpeedCheck:
    """The rows, how they were timed, and the decision on them."""

    rows: list[Row]
    decision: Decision
    timing: Timing
    mark: str = "written"  # what the winner's row is marked with

    @property
    def winner(self) -> Row | None:
        """The row written (tune) or the fastest within budget (eval, timed); None:
        nothing feasible timed, or eval not timed."""
        return self.decision.winner

    @property
    def reason(self) -> str:
        return render(self.decision)

    @property
    def measured(self) -> bool:
        return self.timing.measured

    @property
    def device(self) -> str | None:
        return self.timing.device

    @property
    def batch_size(self) -> int | None:
        return self.timing.batch_size

    @property
    def how(self) -> str:
        return self.timing.how

    @property
    def rounds(self) -> int:
        return self.timing.rounds

    @property
    def retimed(self) -> tuple[str, ...]:
        """Rows timed again: their first timing contradicted the estimate."""
        again = self.decision.reason(Rule.RETIMED)
        return () if again is None else again.rows  # type: ignore[attr-defined]

    def recommendation(self) -> str:
        """Which one a user should pick (``decision.recommend``), in words."""
        fast = recommend(self.rows, self.winner, self.measured)
        if fast is None:
            return "nothing within budget: keep fp32"
        what = "measured" if self.measured else "estimated"
        speed = speed_of(fast, self.measured)
        if fast.role in ("baseline", "recipe"):
            return (f"{fast.name}: the fastest within budget ({what} "
                    f"{speed:.2f}x); the tuned plan does not beat it")
        return f"{fast.name} ({what} {speed:.2f}x)"

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


__all__ = ["SpeedCheck", "speed_metrics"]
