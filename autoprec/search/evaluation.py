"""The score of one plan (kept free of heavy imports: tables and selection use it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Evaluation:
    error: float  # on calibration data, in the budget's units; inf if non-finite
    est_time: float  # seconds per batch on the target (cost model)
    est_speedup: float  # over all-fp32 on the target
    feasible: bool  # within budget (on eval data too, when it is separate) and speed target
    screened: bool = False  # decided on the subset alone
    cached: bool = False  # no model run: seen before
    eval_error: float | None = None  # on eval data (None: not confirmed there)
    train_fidelity: bool | None = None  # --train-aware: a short training run matched fp32
    audit_error: str | None = None  # the audit found a rule that did not run (infeasible)

    def as_attrs(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "error": _finite(self.error),
            "nonfinite": not math.isfinite(self.error),
            "est_time": _finite(self.est_time),
            "est_speedup": self.est_speedup,
            "feasible": self.feasible,
            "screened": self.screened,
        }
        if self.eval_error is not None:
            out["eval_error"] = _finite(self.eval_error)
        if self.audit_error is not None:
            out["audit_error"] = self.audit_error
        if self.train_fidelity is not None:
            out["train_fidelity"] = self.train_fidelity
        return out


def _finite(x: float) -> float:
    """Optuna stores floats; an infinite value is recorded as a huge one (and flagged)."""
    return x if math.isfinite(x) else 1e30
