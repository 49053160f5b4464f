"""Report files and plots (no MLflow): Pareto front, PNGs for awkward inputs, CSV layout,
and the rule that a report file which cannot be written never stops the others."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib.image
import pandas as pd
import pytest

from autoprec.search.select import front_positions
from autoprec.track import Tracker, TrackingWarning, log_tune_artifacts, write_tune_report
from autoprec.track.plots import (
    PRECISION_COLORS,
    baselines_figure,
    baselines_plot,
    layers_figure,
    layers_plot,
    pareto_figure,
    pareto_plot,
)
from tests.track.figures import bars, legend, series, texts

PNG = b"\x89PNG\r\n\x1a\n"
OTHER = "#9467bd"  # the colour of a precision autoprec has none for


class RecordingTracker(Tracker):
    """Implements the interface by remembering calls: what report.py hands a tracker."""

    def __init__(self) -> None:
        self.run_id = "run"
        self.artifacts: list[tuple[str, str | None]] = []
        self.tags: dict[str, str] = {}

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> str | None:
        return self.run_id

    def log_trial(self, number, params, metrics, tags=None) -> None:  # type: ignore[no-untyped-def]
        pass

    def log_metrics(self, metrics: dict[str, float]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        assert Path(path).is_file()
        self.artifacts.append((Path(path).name, artifact_path))

    def finish(self, status: str = "FINISHED") -> None:
        pass


def trials_frame(n: int = 6) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "number": range(n),
            "state": ["COMPLETE"] * (n - 1) + ["FAIL"],
            "error": [0.001 * (i + 1) if i != 2 else math.inf for i in range(n)],
            "est_time": [1.0] * n,
            "est_speedup": [1.0 + 0.2 * i for i in range(n)],
            "feasible": [i < 4 and i != 2 for i in range(n)],
            "params_fc1": ["bf16"] * n,
        }
    )


def test_pareto_front_keeps_only_non_dominated_points() -> None:
    errors = [0.1, 0.05, 0.2, 0.05, 0.3, 0.01]
    speedups = [2.0, 1.5, 1.9, 1.2, 3.0, 1.0]
    front = front_positions(errors, speedups)
    assert [(errors[i], speedups[i]) for i in front] == [
        (0.01, 1.0),
        (0.05, 1.5),
        (0.1, 2.0),
        (0.3, 3.0),
    ]
    assert front_positions([], []) == []


@pytest.mark.parametrize(
    "frame, chosen",
    [
        (trials_frame(), 3),
        (trials_frame(), 99),  # a chosen trial that is not in the table
        (trials_frame().assign(feasible=False), None),
        (trials_frame().assign(error=0.0), 0),  # all-fp32 trials: zero error, linear axis
        (
            trials_frame().assign(
                state="TrialState.COMPLETE", error=[1e-6, 1e-2, 1e-4, 1, 1e-3, 0.5]
            ),
            1,
        ),
        (trials_frame().assign(state="FAIL"), None),  # nothing completed
        (trials_frame().drop(columns=["state", "feasible"]), 1),
    ],
)
def test_pareto_plot_draws_awkward_inputs(
    frame: pd.DataFrame, chosen: int | None, tmp_path: Path
) -> None:
    got = series(pareto_figure(frame, chosen_trial=chosen, budget=0.004))
    done = frame if "state" not in frame else frame[frame["state"].str.endswith("COMPLETE")]
    want = sorted((float(e), float(s)) for e, s in zip(done["error"], done["est_speedup"])
                  if math.isfinite(e))  # completed trials with a finite error
    drawn = sorted(p for label, pts in got.items() if label.startswith("measured,")
                   for p in pts)
    assert drawn == want
    marked = [label for label in got if label.startswith("chosen")]
    assert marked == ([f"chosen (trial {chosen})"] if (chosen, True) in {
        (n, math.isfinite(e)) for n, e in zip(done["number"], done["error"])} else [])
    path = pareto_plot(frame, tmp_path / "p.png", chosen_trial=chosen, budget=0.004)
    assert path.read_bytes()[:8] == PNG
    assert matplotlib.image.imread(path).shape[0] > 100


#: Compute bits a layer's bar is long: sign + exponent + mantissa (tf32: 1 + 8 + 10; fp8
#: e4m3: 1 + 4 + 3); a name autoprec does not know is drawn at fp32's 32.
BITS = {"fp32": 32, "tf32": 19, "bf16": 16, "fp16": 16, "fp8": 8, "int4": 32}


@pytest.mark.parametrize("n", [0, 3, 400])
def test_layers_plot_draws_one_bar_per_layer(n: int, tmp_path: Path) -> None:
    names = list(BITS)  # int4: an unknown name still draws
    layers = {f"blocks.{i}.mlp.fc": names[i % len(names)] for i in range(n)}
    fig = layers_figure(layers)
    got = bars(fig)
    # top to bottom in the given order, each as long as its bits, coloured by precision
    assert [(w, c) for _, w, c in got] == [
        (BITS[p], PRECISION_COLORS.get(p, OTHER)) for p in layers.values()]
    assert OTHER not in PRECISION_COLORS.values()
    # every layer named up to 300 (400 would be unreadable)
    assert [label for label, _, _ in got] == (list(layers) if n <= 300 else [""] * n)
    counts = Counter(layers.values())
    assert (legend(fig) if n else []) == [f"{p} ({counts[p]})" for p in names if p in counts]
    path = layers_plot(layers, tmp_path / "l.png")
    assert path.read_bytes()[:8] == PNG


GREEN, GREY = "#2ca02c", "#b0b0b0"  # within budget, over it


def test_baselines_plot_draws_one_bar_per_plan(tmp_path: Path) -> None:
    rows = pd.DataFrame({
        "plan": ["tuned", "fp32 (no autocast)", "bf16 (one global autocast)",
                 "fp16 (one global autocast)"],
        "est_speedup": [1.8, 1.0, 2.0, 2.1],
        "error": [0.004, 0.0, 0.03, math.inf],
    })
    fig = baselines_figure(rows, budget=0.01)
    assert bars(fig) == [("tuned", 1.8, GREEN), ("fp32 (no autocast)", 1.0, GREEN),
                         ("bf16 (one global autocast)", 2.0, GREY),
                         ("fp16 (one global autocast)", 2.1, GREY)]
    assert texts(fig) == [" 1.80x, error 0.004", " 1.00x, error 0",
                          " 2.00x, error 0.03 (over budget)", " 2.10x, error inf (over budget)"]
    assert fig.axes[0].get_title().endswith("(budget 0.01)")
    # without a budget nothing is over it
    assert {c for _, _, c in bars(baselines_figure(rows))} == {GREEN}
    path = baselines_plot(rows, tmp_path / "b.png", budget=0.01)
    assert path.read_bytes()[:8] == PNG


def test_write_tune_report_files(tmp_path: Path) -> None:
    sens = pd.DataFrame(
        {"local_error": [0.1, 0.2]},
        index=pd.MultiIndex.from_tuples(
            [("fc1", "bf16"), ("fc1", "fp16")], names=["layer", "precision"]
        ),
    )
    written = write_tune_report(
        tmp_path / "r",
        sensitivity=sens,
        trials=trials_frame(),
        layers={"fc1": "bf16"},
        chosen_trial=1,
    )
    assert sorted(written) == ["layers.png", "pareto.png", "sensitivity.csv", "trials.csv"]
    assert list(pd.read_csv(written["sensitivity.csv"]).columns) == [
        "layer",
        "precision",
        "local_error",
    ]
    assert "Unnamed: 0" not in pd.read_csv(written["trials.csv"]).columns
    without = write_tune_report(
        tmp_path / "s", sensitivity=None, trials=trials_frame(), layers={}, chosen_trial=None
    )
    assert "sensitivity.csv" not in without


def test_log_tune_artifacts_layout_and_a_broken_plot(tmp_path: Path) -> None:
    policy = tmp_path / "mlp.yaml"
    policy.write_text("autoprec_policy: 1\ndefault: fp32\nlayers: {fc1: bf16}\n")
    tracker = RecordingTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log_tune_artifacts(
            tracker,
            policy_path=policy,
            sensitivity=None,
            trials=trials_frame(),
            layers={"fc1": "bf16"},
            chosen_trial=0,
            workdir=tmp_path / "r",
        )
    assert tracker.artifacts == [
        ("mlp.yaml", "policy"),
        ("trials.csv", "tables"),
        ("pareto.png", "plots"),
        ("layers.png", "plots"),
    ]
    assert tracker.tags["autoprec.policy_artifact"] == "policy/mlp.yaml"

    broken = RecordingTracker()
    with pytest.warns(TrackingWarning, match="pareto.png"):
        log_tune_artifacts(
            broken,
            policy_path=policy,
            sensitivity=None,
            trials=trials_frame().drop(columns=["error"]),  # the Pareto plot cannot be drawn
            layers={"fc1": "bf16"},
            chosen_trial=0,
            workdir=tmp_path / "b",
        )
    assert [name for name, _ in broken.artifacts] == ["mlp.yaml", "trials.csv", "layers.png"]
