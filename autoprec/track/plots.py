"""The pictures of a tuning run: the plans' Pareto plot, the per-layer precisions, the
baselines.

Drawn with matplotlib's object API on the Agg canvas (no pyplot): no display needed, no
global figure state, safe from any thread. matplotlib is imported inside the functions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from autoprec.formats.gemm import GEMM_FORMAT_BY_NAME
from autoprec.search.select import front_positions

#: One colour per precision (most to least precise, as autoprec.formats.precisions.PRECISIONS).
PRECISION_COLORS: dict[str, str] = {
    "fp32": "#7f7f7f",
    "tf32": "#1f77b4",
    "bf16": "#2ca02c",
    "fp16": "#ff7f0e",
    "fp8": "#d62728",
    "mxfp8": "#8c564b",
    "nvfp4": "#e377c2",
}
#: Bits a value carries in compute (sign + exponent + mantissa); the layer chart's bar length.
PRECISION_BITS: dict[str, int] = {"fp32": 32, "tf32": 19, "bf16": 16, "fp16": 16,
                                  **{n: f.element_bits for n, f in GEMM_FORMAT_BY_NAME.items()}}
_OTHER_COLOR = "#9467bd"


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def _completed(trials: pd.DataFrame) -> pd.DataFrame:
    if "state" not in trials.columns:
        return trials
    # Optuna writes "COMPLETE" (trials_dataframe) or "TrialState.COMPLETE" (str(state)).
    return trials[trials["state"].astype(str).str.upper().str.endswith("COMPLETE")]


Point = tuple[float, float]  # (error, estimated speed-up over fp32)

#: Priced plans drawn at most (the rest of a 2 M-plan enumeration is sampled, the priced
#: front is always drawn whole).
MAX_PRICED_POINTS = 4000


@dataclass
class ParetoData:
    """What ``pareto.png`` shows, computed apart from the drawing (so a test reads it).

    ``priced``: the plans the search priced (predicted error, estimated speed-up), sampled
    to ``MAX_PRICED_POINTS`` with ``priced_front`` kept whole; ``feasible`` /
    ``infeasible``: the plans run on the model (calibration error); ``baselines``: what a
    user would write instead (fp32, the one-liners: name, error, speed-up); ``chosen``:
    the written plan; ``budget``: the vertical line.
    """

    priced: list[Point] = field(default_factory=list)
    priced_total: int = 0
    priced_front: list[Point] = field(default_factory=list)
    feasible: list[Point] = field(default_factory=list)
    infeasible: list[Point] = field(default_factory=list)
    measured_front: list[Point] = field(default_factory=list)
    baselines: list[tuple[str, float, float]] = field(default_factory=list)
    chosen: tuple[float, float, str] | None = None
    budget: float | None = None
    hidden: int = 0  # measured plans with a non-finite error (counted, not drawn)

    def points(self) -> list[Point]:
        return [*self.priced, *self.priced_front, *self.feasible, *self.infeasible,
                *((e, s) for _n, e, s in self.baselines)]


def _finite(e: float, s: float) -> bool:
    return math.isfinite(e) and math.isfinite(s)


def pareto_data(
    trials: pd.DataFrame,
    *,
    priced: tuple[Sequence[float], Sequence[float]] | None = None,
    baselines: pd.DataFrame | None = None,
    chosen_trial: int | None = None,
    chosen: Point | None = None,
    budget: float | None = None,
    max_points: int = MAX_PRICED_POINTS,
) -> ParetoData:
    """The series of the Pareto plot. ``trials``: tune's trials table; ``priced``:
    (predicted errors, estimated speed-ups) of every plan the planner priced; ``baselines``:
    rows with ``plan``, ``error``, ``est_speedup`` (a ``tuned`` row is skipped: it is the
    chosen point); ``chosen``: the written plan's point when it is no trial of the table
    (a baseline won the measurement)."""
    data = ParetoData(budget=budget if budget is not None and math.isfinite(budget) else None)
    if priced is not None:
        import numpy as np

        errs, spds = np.asarray(priced[0], dtype=float), np.asarray(priced[1], dtype=float)
        ok = np.isfinite(errs) & np.isfinite(spds)
        errs, spds = errs[ok], spds[ok]
        data.priced_total = int(errs.size)
        # front_positions' rule, vectorised (an enumeration prices up to 2 M plans)
        order = np.lexsort((-spds, errs))
        best = np.maximum.accumulate(spds[order])
        new_best = np.concatenate([[True], best[1:] > best[:-1]]) if order.size else order
        front = order[new_best.astype(bool)] if order.size else order
        data.priced_front = [(float(errs[i]), float(spds[i])) for i in front]
        rest = np.setdiff1d(np.arange(errs.size), front)
        if rest.size > max_points:
            rest = np.sort(np.random.default_rng(0).choice(rest, max_points, replace=False))
        data.priced = [(float(errs[i]), float(spds[i])) for i in rest]
    df = _completed(trials)
    if len(df):
        # what the search scored (tune's trials table: calibration_error; else `error`)
        error = pd.to_numeric(df.get("calibration_error", df.get("error")),
                              errors="coerce").astype(float)
        speedup = pd.to_numeric(df.get("est_speedup"), errors="coerce").astype(float)
        if "feasible" in df.columns:
            feasible = df["feasible"].astype("boolean").fillna(False).astype(bool)
        elif budget is not None:
            feasible = error <= budget
        else:
            feasible = pd.Series(True, index=df.index)
        for i in df.index:
            e, s = float(error[i]), float(speedup[i])
            if not _finite(e, s):
                data.hidden += 1
                continue
            (data.feasible if feasible[i] else data.infeasible).append((e, s))
        drawn = [*data.feasible, *data.infeasible]
        front = front_positions([e for e, _ in drawn], [s for _, s in drawn])
        data.measured_front = [drawn[i] for i in front]
        if chosen_trial is not None and "number" in df.columns:
            row = df[df["number"] == chosen_trial]
            if len(row) and _finite(float(error[row.index[0]]), float(speedup[row.index[0]])):
                data.chosen = (float(error[row.index[0]]), float(speedup[row.index[0]]),
                               f"chosen (trial {chosen_trial})")
    if data.chosen is None and chosen is not None and _finite(*chosen):
        data.chosen = (float(chosen[0]), float(chosen[1]), "chosen")
    if baselines is not None:
        for _, r in baselines.iterrows():
            name = str(r["plan"])
            e, s = float(r["error"]), float(r["est_speedup"])
            if name != "tuned" and math.isfinite(s):
                data.baselines.append((name, e, s))
    return data


#: One marker per baseline (fp32, then the one-liners).
_BASELINE_MARKERS = ("s", "D", "^", "v", "P", "X", "h")


def pareto_plot(trials: pd.DataFrame, path: Path, **kwargs: Any) -> Path:
    """``pareto_figure(trials, **kwargs)`` written to ``path`` (PNG); returns ``path``."""
    return _save(pareto_figure(trials, **kwargs), path)


def pareto_figure(
    trials: pd.DataFrame,
    *,
    chosen_trial: int | None = None,
    budget: float | None = None,
    priced: tuple[Sequence[float], Sequence[float]] | None = None,
    baselines: pd.DataFrame | None = None,
    chosen: Point | None = None,
    title: str = "Plans: error vs estimated speed-up",
) -> Any:
    """The chosen plan among its alternatives (``pareto_data``): the priced plans and their
    front, the plans measured on the model, the baselines and the budget. Baselines with an
    infinite error (fp16 overflow) are drawn at the right edge. Returns the Figure."""
    d = pareto_data(trials, priced=priced, baselines=baselines, chosen_trial=chosen_trial,
                    chosen=chosen, budget=budget)
    fig = _figure(7.6, 5.0)
    ax = fig.add_subplot()
    finite = [(e, s) for e, s in d.points() if _finite(e, s)]
    if not finite:
        ax.text(0.5, 0.5, "no plan with a finite error", ha="center", va="center")
        ax.set_axis_off()
        ax.set_title(title, fontsize=10)
        return fig
    errs = [e for e, _ in finite]
    right = max(errs + ([d.budget] if d.budget else [])) * 1.5 or 1.0

    def xy(points: Sequence[Point]) -> tuple[list[float], list[float]]:
        return [p[0] for p in points], [p[1] for p in points]

    if d.priced or d.priced_front:
        ax.scatter(*xy(d.priced + d.priced_front), s=6, color="#aec7e8", alpha=0.5,
                   linewidths=0, label=f"priced plans ({d.priced_total}, predicted error)")
        ax.plot(*xy(d.priced_front), drawstyle="steps-post", color="#1f77b4", lw=1,
                alpha=0.8, label="priced front")
    for pts, style in ((d.feasible, {"marker": "o", "color": "#2ca02c", "label": "measured, feasible"}),
                       (d.infeasible, {"marker": "x", "color": "#7f7f7f",
                                       "label": "measured, infeasible"})):
        if pts:
            style["label"] = f"{style['label']} ({len(pts)})"
            ax.scatter(*xy(pts), s=30, alpha=0.9, zorder=3, **style)
    if len(d.measured_front) > 1:
        ax.plot(*xy(d.measured_front), drawstyle="steps-post", color="#2ca02c", lw=1.2,
                label="measured front")
    for (name, e, s), marker in zip(d.baselines, _BASELINE_MARKERS * 3):
        shown = e if math.isfinite(e) else right
        ax.scatter([shown], [s], marker=marker, s=50, facecolors="none", edgecolors="#9467bd",
                   zorder=6, label=name + ("" if math.isfinite(e) else " (error inf, at edge)"))
    if d.chosen is not None:
        ax.scatter([d.chosen[0]], [d.chosen[1]], marker="*", s=260, color="#d62728", zorder=5,
                   label=d.chosen[2])
    if d.budget is not None:
        ax.axvline(d.budget, ls="--", color="#d62728", lw=1, label=f"budget {d.budget:g}")
    ax.axhline(1.0, ls=":", color="#7f7f7f", lw=1)  # all-fp32 speed
    positive = [e for e in errs if e > 0]
    if positive and max(positive) / min(positive) > 50:
        if len(positive) < len(errs):  # fp32's error is 0: linear near 0, log beyond
            ax.set_xscale("symlog", linthresh=min(positive))
            ax.set_xlim(left=-0.05 * min(positive))
        else:
            ax.set_xscale("log")
    ax.set_xlabel("error (vs the fp32 reference; priced plans: predicted)")
    ax.set_ylabel("estimated speed-up over fp32 (x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if d.hidden:
        title += f"  ({d.hidden} measured with a non-finite error not shown)"
    ax.set_title(title, fontsize=10)
    return fig


def layers_plot(layers: dict[str, str], path: Path, **kwargs: Any) -> Path:
    """``layers_figure(layers, **kwargs)`` written to ``path`` (PNG); returns ``path``."""
    return _save(layers_figure(layers, **kwargs), path)


def layers_figure(layers: dict[str, str], *, title: str = "Precision per GEMM layer") -> Any:
    """One bar per layer (in the given order, top to bottom), coloured by precision; the
    bar's length is the precision's compute bits. Returns the Figure."""
    names = list(layers)
    n = len(names)
    fig = _figure(8.0, min(1.6 + 0.22 * n, 80.0))
    ax = fig.add_subplot()
    if n == 0:
        ax.text(0.5, 0.5, "no per-layer rules: every layer at the default", ha="center")
        ax.set_axis_off()
        ax.set_title(title, fontsize=10)
        return fig
    precisions = [str(layers[name]) for name in names]
    colors = [PRECISION_COLORS.get(p, _OTHER_COLOR) for p in precisions]
    bits = [PRECISION_BITS.get(p, 32) for p in precisions]
    positions = list(range(n - 1, -1, -1))  # first layer on top
    ax.barh(positions, bits, color=colors, height=0.8)
    if n <= 300:
        ax.set_yticks(positions, names, fontsize=max(4.0, min(8.0, 700.0 / n)))
    else:
        ax.set_yticks([])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xticks(sorted(set(PRECISION_BITS.values())))
    ax.set_xlabel("compute bits")
    counts = Counter(precisions)
    order = [p for p in PRECISION_COLORS if p in counts] + sorted(
        p for p in counts if p not in PRECISION_COLORS
    )
    from matplotlib.patches import Patch

    handles = [
        Patch(color=PRECISION_COLORS.get(p, _OTHER_COLOR), label=f"{p} ({counts[p]})")
        for p in order
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{title} ({n} layers)", fontsize=10)
    return fig


def baselines_plot(rows: pd.DataFrame, path: Path, **kwargs: Any) -> Path:
    """``baselines_figure(rows, **kwargs)`` written to ``path`` (PNG); returns ``path``."""
    return _save(baselines_figure(rows, **kwargs), path)


def baselines_figure(rows: pd.DataFrame, *, budget: float | None = None,
                     title: str = "Tuned plan against one global autocast") -> Any:
    """Bars of estimated speed-up (``plan``, ``est_speedup``, ``error`` columns; the tuned
    plan first), green within ``budget`` and grey over it, each labelled with its error.
    Returns the Figure."""
    names = [str(v) for v in rows["plan"]]
    speed = [float(v) for v in rows["est_speedup"]]
    errors = [float(v) for v in rows["error"]]
    fig = _figure(7.0, 1.4 + 0.45 * len(names))
    ax = fig.add_subplot()
    ok = [budget is None or (math.isfinite(e) and e <= budget) for e in errors]
    positions = list(range(len(names) - 1, -1, -1))
    ax.barh(positions, speed, color=["#2ca02c" if k else "#b0b0b0" for k in ok], height=0.7)
    ax.set_yticks(positions, names, fontsize=8)
    for y, s, e, k in zip(positions, speed, errors, ok):
        label = f" {s:.2f}x, error {e:.3g}" if math.isfinite(e) else f" {s:.2f}x, error inf"
        ax.text(s, y, label + ("" if k else " (over budget)"), va="center", fontsize=7)
    ax.set_xlabel("estimated speed-up over fp32 (x)")
    ax.set_xlim(0, max(speed + [1.0]) * 1.45)
    ax.set_title(title + (f" (budget {budget:g})" if budget is not None else ""), fontsize=10)
    return fig
