"""The score of one assignment (kept free of heavy imports: tables and selection use it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Evaluation:
    error: float  # in the budget's units (relative L2 or metric drop); inf if non-finite
    est_time: float  # seconds per batch on the target (cost model)
    est_speedup: float  # over all-fp32 on the target
    feasible: bool  # error <= budget (and speed-up >= min_speedup)
    screened: bool = False  # decided on the subset alone
    cached: bool = False  # no model run: seen before

    def as_attrs(self) -> dict[str, Any]:
        return {
            "error": _finite(self.error),
            "nonfinite": not math.isfinite(self.error),
            "est_time": self.est_time,
            "est_speedup": self.est_speedup,
            "feasible": self.feasible,
            "screened": self.screened,
        }


def _finite(x: float) -> float:
    """Optuna stores floats; an infinite error is recorded as a huge one (and flagged)."""
    return x if math.isfinite(x) else 1e30
