"""The two pictures of a tuning run: the trials' Pareto plot and the per-layer precisions.

Drawn with matplotlib's object API on the Agg canvas (no pyplot): no display needed, no
global figure state, safe from any thread. matplotlib is imported inside the functions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

#: One colour per precision (most to least precise, as autoprec.precisions.PRECISIONS).
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
PRECISION_BITS: dict[str, int] = {"fp32": 32, "tf32": 19, "bf16": 16, "fp16": 16, "fp8": 8,
                                  "mxfp8": 8, "nvfp4": 4}
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


def pareto_front(errors: Sequence[float], speedups: Sequence[float]) -> list[int]:
    """Positions of the non-dominated points (lower error, higher speed-up), by error.

    A point is on the front when no other point has an error at most as large and a
    strictly larger speed-up (or an equal speed-up and a strictly smaller error).
    """
    order = sorted(range(len(errors)), key=lambda i: (errors[i], -speedups[i]))
    front: list[int] = []
    best = -math.inf
    for i in order:
        if speedups[i] > best:
            front.append(i)
            best = speedups[i]
    return front


def _completed(trials: pd.DataFrame) -> pd.DataFrame:
    if "state" not in trials.columns:
        return trials
    # Optuna writes "COMPLETE" (trials_dataframe) or "TrialState.COMPLETE" (str(state)).
    return trials[trials["state"].astype(str).str.upper().str.endswith("COMPLETE")]


def pareto_plot(
    trials: pd.DataFrame,
    path: Path,
    *,
    chosen_trial: int | None = None,
    budget: float | None = None,
    title: str = "Trials: error vs estimated speed-up",
) -> Path:
    """Scatter of completed trials (error vs est_speedup): feasible or not, the Pareto
    front, the budget and the chosen trial. Trials with a non-finite error are counted in
    the title, not drawn. Returns ``path`` (PNG)."""
    df = _completed(trials)
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
    drawn = error.map(math.isfinite) & speedup.map(math.isfinite)
    hidden = int((~drawn).sum())

    fig = _figure(7.0, 4.8)
    ax = fig.add_subplot()
    if not drawn.any():
        ax.text(0.5, 0.5, "no completed trial with a finite error", ha="center", va="center")
        ax.set_axis_off()
    else:
        for mask, style in (
            (drawn & feasible, {"marker": "o", "color": "#2ca02c", "label": "feasible"}),
            (drawn & ~feasible, {"marker": "x", "color": "#7f7f7f", "label": "infeasible"}),
        ):
            if mask.any():
                style["label"] = f"{style['label']} ({int(mask.sum())})"
                ax.scatter(error[mask], speedup[mask], s=28, alpha=0.8, **style)
        errs, spds = error[drawn].tolist(), speedup[drawn].tolist()
        front = pareto_front(errs, spds)
        ax.plot(
            [errs[i] for i in front],
            [spds[i] for i in front],
            drawstyle="steps-post",
            color="#1f77b4",
            lw=1.2,
            label="Pareto front",
        )
        if chosen_trial is not None and "number" in df.columns:
            row = df[(df["number"] == chosen_trial) & drawn]
            if len(row):
                x, y = float(error[row.index[0]]), float(speedup[row.index[0]])
                ax.scatter(
                    [x],
                    [y],
                    marker="*",
                    s=260,
                    color="#d62728",
                    zorder=5,
                    label=f"chosen (trial {chosen_trial})",
                )
        if budget is not None and math.isfinite(budget):
            ax.axvline(budget, ls="--", color="#d62728", lw=1, label=f"budget {budget:g}")
        ax.axhline(1.0, ls=":", color="#7f7f7f", lw=1)  # all-fp32 speed
        positive = [e for e in errs if e > 0]
        if len(positive) == len(errs) and max(errs) / min(errs) > 50:
            ax.set_xscale("log")
        ax.set_xlabel("error (vs the fp32 reference)")
        ax.set_ylabel("estimated speed-up over fp32 (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    if hidden:
        title += f"  ({hidden} with a non-finite error not shown)"
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def layers_plot(layers: dict[str, str], path: Path, *,
                title: str = "Precision per GEMM layer") -> Path:
    """One bar per layer (in the given order, top to bottom), coloured by precision; the
    bar's length is the precision's compute bits. Returns ``path`` (PNG)."""
    names = list(layers)
    n = len(names)
    fig = _figure(8.0, min(1.6 + 0.22 * n, 80.0))
    ax = fig.add_subplot()
    if n == 0:
        ax.text(0.5, 0.5, "no per-layer rules: every layer at the default", ha="center")
        ax.set_axis_off()
        ax.set_title(title, fontsize=10)
        return _save(fig, path)
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
    return _save(fig, path)


def baselines_plot(rows: pd.DataFrame, path: Path, *, budget: float | None = None,
                   title: str = "Tuned plan against one global autocast") -> Path:
    """Bars of estimated speed-up (``plan``, ``est_speedup``, ``error`` columns; the tuned
    plan first), green within ``budget`` and grey over it, each labelled with its error.
    Returns ``path`` (PNG)."""
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
    return _save(fig, path)
