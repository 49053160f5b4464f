"""What ``eval --json`` and ``check --json`` share: one meaning for each summary field.

- ``reasons``: why the verdict is negative — a list of ``{"layer": path | None, "reason":
  text}``, ``layer`` naming the module to blame (the first layer that overflowed, a layer
  the target cannot run, a GEMM the audit caught) or None for the whole model (over budget,
  a changed fingerprint). Empty when the policy is feasible (eval) / passed (check). Why a
  single layer stays at a higher precision (the policy file's ``reasons``) is that layer's
  row's ``reason`` in ``layers``.
- ``feasible``: the policy, as applied here, is within a known budget on the eval data, the
  target can run every precision it uses, and the audit found every GEMM computing as its
  rule says. ``false`` when any of these fails — a non-finite error always does; ``null``
  when no budget is known (a hand-written policy given to ``eval``) and nothing else fails.
- ``est_speedup``: over all-fp32 on the target; ``null`` when the target cannot run the
  policy (there is no speed to estimate).
- ``batch_size_from``: where ``batch_size`` (the batch the speed is priced at) came from:
  ``"--batch-size"``, ``"policy"`` (its ``target.batch_size``) or ``"calibration batch"``
  (the leading dimension of calibration_data()'s first batch).
- Numbers: JSON has no inf/nan; they are written as the strings ``"inf"``, ``"-inf"``,
  ``"nan"`` (as tune's ``--json`` does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class Reason(str):
    """A reason's text (a plain ``str`` to every caller) and the layer it is about."""

    layer: str | None

    def __new__(cls, text: str, layer: str | None = None) -> Reason:
        obj = super().__new__(cls, text)
        obj.layer = layer
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (Reason, (str(self), self.layer))


def reasons_json(reasons: Iterable[str]) -> list[dict[str, str | None]]:
    """``[{"layer": …, "reason": …}]``; a plain string is about the whole model."""
    return [{"layer": getattr(r, "layer", None), "reason": str(r)} for r in reasons]


def audit_reasons(report: Any) -> list[Reason]:
    """The audit's errors, each with its layer (one error per mismatched row)."""
    bad = [row.layer for row in report.rows if not row.ok]
    errors = list(report.errors)
    layers = bad if len(bad) == len(errors) else [None] * len(errors)
    return [Reason(f"audit: {e}", layer) for e, layer in zip(errors, layers)]


def verdict_reasons(value: float | None, budget: float | None, *, name: str = "error",
                    infeasible: Iterable[str | tuple[str, str]] = (),
                    audit: Any = None) -> list[Reason]:
    """``eval``'s reasons for the rule above: a non-finite or over-budget ``value`` (the
    whole model), each layer the target cannot run (``"path: why"`` or ``(path, why)``),
    each audit error."""
    out: list[Reason] = []
    if value is not None and not math.isfinite(float(value)):
        out.append(Reason(f"{name} {number(float(value))}: non-finite output values under "
                          "the policy"))
    elif value is not None and budget is not None and not float(value) <= float(budget):
        out.append(Reason(f"{name} {float(value):.4g} > budget {float(budget):g} on eval data"))
    for item in infeasible:
        path, why = item if isinstance(item, tuple) else (
            item.split(": ", 1) if ": " in item else (None, item))
        out.append(Reason(f"layer {path!r} cannot run on the target: {why}"
                          if path is not None else why, path))
    if audit is not None:
        out.extend(audit_reasons(audit))
    return out


def feasible(value: float | None, budget: float | None, *, runnable: bool = True,
             audit_ok: bool = True) -> bool | None:
    """The ``feasible`` rule above. ``value``: the error (or metric drop) on the eval data,
    None when it was not evaluated."""
    if not runnable or not audit_ok or value is None:
        return False
    value = float(value)
    if not math.isfinite(value):
        return False
    if budget is None:
        return None
    return value <= float(budget)


def speedup(est: float | None, *, runnable: bool, digits: int = 4) -> float | None:
    """``est_speedup`` for JSON: None when the target cannot run the policy."""
    if not runnable or est is None or not math.isfinite(est) or est <= 0:
        return None
    return round(float(est), digits)


def batch_size_from(given: int | None, recorded: int | None = None) -> str:
    """Where the priced batch size came from (``batch_size_from`` above)."""
    if given is not None:
        return "--batch-size"
    return "policy" if recorded is not None else "calibration batch"


def batch_size_words(batch_size: Any, source: str) -> str:
    """"batch size 8 (the calibration batch's; ...)" for people: the size and its source."""
    why = {"--batch-size": "--batch-size", "policy": "the policy's target.batch_size",
           "calibration batch": "the calibration batch's; give the deployment's with "
           "--batch-size N"}.get(source, source)
    return f"batch size {batch_size} ({why})"


def number(x: Any) -> Any:
    """A float for JSON: inf/nan as strings; anything else unchanged."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


__all__ = ["Reason", "audit_reasons", "batch_size_from", "batch_size_words", "feasible",
           "number", "reasons_json", "speedup", "verdict_reasons"]
