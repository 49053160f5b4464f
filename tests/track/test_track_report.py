"""Report files and plots (no MLflow): Pareto front, PNGs for awkward inputs, CSV layout,
and the rule that a report file which cannot be written never stops the others."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import matplotlib.image
import pandas as pd
import pytest

from autoprec.track import Tracker, TrackingWarning, log_tune_artifacts, write_tune_report
from autoprec.track.plots import layers_plot, pareto_front, pareto_plot

PNG = b"\x89PNG\r\n\x1a\n"


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
    front = pareto_front(errors, speedups)
    assert [(errors[i], speedups[i]) for i in front] == [
        (0.01, 1.0),
        (0.05, 1.5),
        (0.1, 2.0),
        (0.3, 3.0),
    ]
    assert pareto_front([], []) == []


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
    path = pareto_plot(frame, tmp_path / "p.png", chosen_trial=chosen, budget=0.004)
    assert path.read_bytes()[:8] == PNG
    assert matplotlib.image.imread(path).shape[0] > 100


@pytest.mark.parametrize("n", [0, 3, 400])
def test_layers_plot_scales_with_layer_count(n: int, tmp_path: Path) -> None:
    names = ["fp32", "tf32", "bf16", "fp16", "fp8", "int4"]  # int4: an unknown name still draws
    layers = {f"blocks.{i}.mlp.fc": names[i % len(names)] for i in range(n)}
    path = layers_plot(layers, tmp_path / "l.png")
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
