"""End-to-end runs: the whole model with only one layer lowered, scored by autoprec.workload.scoring.

A run costs one pass over the calibration data, so the probe makes them only where asked
(``e2e="all"`` or a list) or, with ``e2e="auto"``, where the cheap estimate is ambiguous:
within a factor ``band`` (2) of the budget, closest first, at most ``limit`` (8) runs —
benchmarks/probe_correlation.py finds 86-100% of estimates within 2x of the measured
error, so outside that band the side of the budget is clear. With a metric the budget is
a metric drop, which the estimate (an output error) cannot be compared with: "auto" then
measures the pairs with the largest estimates, two per precision at most, in turn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from autoprec.errors import InputError
from autoprec.probe.layers import ProbeLayer, lowered_alone
from autoprec.workload.loading import ModelSpec
from autoprec.workload.scoring import Reference, Score, score

Pair = tuple[str, str]

E2E_MODES = ("auto", "all", "none")


def measure(spec: ModelSpec, model: nn.Module, batches: Sequence[Any], ref: Reference,
            layer: ProbeLayer, precision: str, fp8_backend: str = "emulated") -> Score:
    """Score the model with only ``layer`` in ``precision`` (everything else fp32)."""
    with lowered_alone(layer, precision, fp8_backend):
        return score(spec, model, batches, ref, f"with {layer.name} in {precision}")


def choose(e2e: str | Sequence[Any], layers: Sequence[ProbeLayer], estimates: dict[Pair, float],
           hard: set[Pair], budget: float, has_metric: bool, limit: int = 8,
           band: float = 2.0) -> list[Pair]:
    """The (layer, precision) pairs to run end to end, in the order to run them."""
    allowed = [(lay.path, p) for lay in layers for p in lay.precisions]
    if isinstance(e2e, str):
        if e2e not in E2E_MODES:
            raise InputError(f"e2e: expected auto, all, none or a list of layers, got {e2e!r}")
        if e2e == "none":
            return []
        if e2e == "all":
            return allowed
        return _auto(allowed, estimates, hard, budget, has_metric, limit, band)
    by_path = {lay.path: lay for lay in layers}
    chosen: list[Pair] = []
    for item in e2e:
        path, prec = (item, None) if isinstance(item, str) else tuple(item)
        if path not in by_path:
            raise InputError(f"e2e: {path!r} is not a probed layer")
        precs = by_path[path].precisions if prec is None else (prec,)
        for p in precs:
            if p not in by_path[path].precisions:
                why = by_path[path].disallowed.get(p, f"{p} was not probed")
                raise InputError(f"e2e: {path!r} cannot run in {p}: {why}")
            if (path, p) not in chosen:
                chosen.append((path, p))
    return chosen


def _auto(allowed: list[Pair], estimates: dict[Pair, float], hard: set[Pair], budget: float,
          has_metric: bool, limit: int, band: float) -> list[Pair]:
    cands = [k for k in allowed if k not in hard and math.isfinite(estimates.get(k, math.nan))]
    if has_metric:
        # No common unit with the budget: the largest estimates of each precision, in turn.
        limit = min(limit, 2 * len({p for _, p in cands}))
        per: dict[str, list[Pair]] = {}
        for k in sorted(cands, key=lambda k: -estimates[k]):
            per.setdefault(k[1], []).append(k)
        out: list[Pair] = []
        while len(out) < limit and any(per.values()):
            for lst in per.values():
                if lst and len(out) < limit:
                    out.append(lst.pop(0))
        return out
    lo, hi = budget / band, budget * band
    near = [k for k in cands if lo <= estimates[k] <= hi]
    near.sort(key=lambda k: abs(math.log(max(estimates[k], 1e-300) / budget)))
    return near[:limit]
