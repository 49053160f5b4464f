"""The rows a tuned plan is shown beside.

A ``Row`` is one plan — the tuned one, the next candidates, a baseline (what a user
writes instead: ``baselines.BASELINES``) — with its error (eval data, the budget's
units), its estimated speed-up and weight bytes on the target's cost model, and, once
timed (``timing.measure_rows``, which ``fill_measured``), its measured speed-up over fp32
with the p10-p90 spread. ``decision.decide`` chooses among them; ``speed_check.SpeedCheck``
is the table with the decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoprec.policy import Policy
from autoprec.policy.build import plan_id

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
        """The plan's name (``policy.build.plan_id``: form, default and rules): rows of one key
        install the same and are timed once (why by name, not by what runs:
        ``search.decode``)."""
        if self.policy is None:
            return None
        return plan_id(self.policy.default, self.policy.layers, self.policy.form)

    def to_dict(self) -> dict[str, Any]:
        def num(x: float | None, nd: int = 4) -> Any:
            if x is None:
                return None
            return round(x, nd) if math.isfinite(x) else ("inf" if x > 0 else "nan")

        out: dict[str, Any] = {"name": self.name, "role": self.role,
                               "error": num(self.error, 6), "feasible": self.feasible,
                               # 0: the cost model cannot price it (a model.to(bf16)
                               # row of the train form: no fp32 masters to step) -> none
                               "est_speedup": num(self.est_speedup) if self.est_speedup
                               else None,
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


__all__ = ["FAULTS_NOTED", "Row", "Timer", "fill_measured", "format_rows", "label"]
