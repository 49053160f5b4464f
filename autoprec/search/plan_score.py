"""The score of one plan, and the one way it is stored on a trial and read back.

Kept free of heavy imports: tables and selection use it. ``to_attrs`` writes a trial's
``user_attrs``; ``from_attrs`` reads them (the plan scorer's cache, the sampler, selection,
the trial tables). Infinities are stored as such (JSON ``Infinity``, which every Optuna
storage round-trips); studies written before stored ``1e30`` with ``nonfinite: true``,
which still reads as inf.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class PlanScore:
    error: float  # on calibration data, in the budget's units; inf if non-finite
    est_time: float  # seconds per batch on the target (cost model)
    est_speedup: float  # over all-fp32 on the target
    feasible: bool  # within budget (on eval data too, when it is separate) and speed target
    screened: bool = False  # decided on the subset alone
    cached: bool = False  # no model run: seen before
    eval_error: float | None = None  # on eval data (None: not confirmed there)
    train_fidelity: bool | None = None  # --train-aware: a short training run matched fp32
    audit_error: str | None = None  # the audit found a rule that did not run (infeasible)

    def to_attrs(self) -> dict[str, Any]:
        """The trial's ``user_attrs`` for this evaluation."""
        out: dict[str, Any] = {
            "error": self.error,
            "nonfinite": not math.isfinite(self.error),
            "est_time": self.est_time,
            "est_speedup": self.est_speedup,
            "feasible": self.feasible,
            "screened": self.screened,
        }
        if self.eval_error is not None:
            out["eval_error"] = self.eval_error
        if self.audit_error is not None:
            out["audit_error"] = self.audit_error
        if self.train_fidelity is not None:
            out["train_fidelity"] = self.train_fidelity
        return out


    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any], cached: bool = True) -> PlanScore | None:
        """The evaluation a trial stored (None: the trial holds none, e.g. skipped; a
        record without ``est_time`` reads as not priced, inf)."""
        if "error" not in attrs:
            return None
        eval_error = attrs.get("eval_error")
        return cls(
            _read(attrs["error"], bool(attrs.get("nonfinite"))), _read(attrs.get("est_time", math.inf)),
            float(attrs.get("est_speedup", 0.0)), bool(attrs.get("feasible", False)),
            bool(attrs.get("screened", False)), cached,
            None if eval_error is None else _read(eval_error), attrs.get("train_fidelity"),
            attrs.get("audit_error"))


#: What studies written before this format stored for an infinite value.
_OLD_INF = 1e30


def _read(x: Any, nonfinite: bool = False) -> float:
    value = float(x)
    return math.inf if nonfinite or value >= _OLD_INF else value
