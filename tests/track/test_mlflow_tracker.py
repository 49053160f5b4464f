"""The MLflow tracker against real MLflow: a loopback ``mlflow server`` and the SQLite default.

Everything is read back with a fresh ``MlflowClient``: parent run, child runs (found by
``tags.mlflow.parentRunId``), their metrics and params, and the downloaded artifacts.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
from mlflow import MlflowClient

from autoprec.errors import TrackingError
from autoprec.policy import load_policy
from autoprec.track import (
    MlflowTracker,
    NullTracker,
    TrackingWarning,
    log_tune_artifacts,
    make_tracker,
)
from autoprec.track.plots import pareto_figure, pareto_plot
from tests.track.figures import series

POLICY_TEXT = "autoprec_policy: 1\ndefault: fp32\nlayers: {fc1: bf16}\n"
N_TRIALS = 8
WORKER = Path(__file__).with_name("_track_worker.py")


def trial_metrics(number: int) -> dict[str, float]:
    error = math.inf if number == 5 else 0.002 * (number + 1)
    return {"error": error, "est_time": 1.0 / (1 + number), "est_speedup": 1.0 + 0.1 * number}


def trial_params(number: int) -> dict[str, str]:
    return {"fc1": "bf16" if number % 2 else "fp16", "fc2": "fp32", "head.out": "fp8"}


def fake_trials() -> pd.DataFrame:
    rows = []
    for number in range(N_TRIALS):
        metrics = trial_metrics(number)
        rows.append(
            {
                "number": number,
                "state": "FAIL" if number == 6 else "COMPLETE",
                **metrics,
                "feasible": metrics["error"] <= 0.01,
                **{f"params_{k}": v for k, v in trial_params(number).items()},
            }
        )
    return pd.DataFrame(rows)


def fake_sensitivity() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "layer": ["fc1", "fc1", "fc2"],
            "precision": ["bf16", "fp16", "bf16"],
            "local_error": [0.004, 0.001, 0.003],
            "e2e_error": [0.002, 0.0007, 0.001],
        }
    )


@pytest.fixture(params=[pytest.param("server", marks=pytest.mark.slow), "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str | None, Path]:
    """(uri for make_tracker, workdir): the shared loopback server, or the SQLite default."""
    if request.param == "server":
        return request.getfixturevalue("mlflow_server_uri"), tmp_path
    return None, tmp_path


def children(client: MlflowClient, experiment_id: str, parent_id: str) -> list:
    return client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'", max_results=1000
    )


def test_full_run_round_trips(store: tuple[str | None, Path], experiment: str) -> None:
    uri, workdir = store
    policy = workdir / "policies" / "mlp.yaml"
    policy.parent.mkdir()
    policy.write_text(POLICY_TEXT)

    tracker = make_tracker(uri, experiment, workdir=workdir)
    assert isinstance(tracker, MlflowTracker)
    if uri is None:
        assert tracker.uri == f"sqlite:///{workdir.resolve()}/mlflow.db"
    params = {"budget": 0.01, "target": "h100", "seed": 0, "model": "mlp", "n_layers": 3}
    tags = {"autoprec.study": "mlp-study", "autoprec.storage": "sqlite:///studies.db"}
    run_id = tracker.start("tune-mlp", params, tags)
    assert run_id and tracker.run_id == run_id

    def log(number: int) -> None:
        state = {"autoprec.state": "FAIL"} if number == 6 else {}
        tracker.log_trial(number, trial_params(number), trial_metrics(number), state)

    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackingWarning)  # nothing may fail quietly here
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(log, range(N_TRIALS)))
        tracker.log_metrics({"error": 0.004, "est_speedup": 1.4})
        tracker.set_tags({"autoprec.chosen_trial": "3"})
        log_tune_artifacts(
            tracker,
            policy_path=policy,
            sensitivity=fake_sensitivity(),
            trials=fake_trials(),
            layers={"fc1": "bf16", "fc2": "fp32", "head.out": "fp8"},
            chosen_trial=3,
            workdir=workdir / "report",
            budget=0.01,
        )
        tracker.finish()
    assert tracker.enabled

    client = MlflowClient(tracker.uri)  # a fresh client: only what reached the store counts
    parent = client.get_run(run_id)
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "tune-mlp"
    assert parent.data.params["budget"] == "0.01" and parent.data.params["n_layers"] == "3"
    assert parent.data.tags["autoprec.study"] == "mlp-study"
    assert parent.data.tags["autoprec.storage"] == "sqlite:///studies.db"
    assert parent.data.tags["autoprec.policy_artifact"] == "policy/mlp.yaml"
    assert parent.data.metrics["est_speedup"] == pytest.approx(1.4)
    assert len(client.get_metric_history(run_id, "trials/error")) == N_TRIALS

    kids = children(client, tracker.experiment_id, run_id)
    assert len(kids) == N_TRIALS
    by_number = {int(run.data.tags["autoprec.trial"]): run for run in kids}
    assert sorted(by_number) == list(range(N_TRIALS))
    for number, run in by_number.items():
        expected = trial_metrics(number)
        assert run.data.params == trial_params(number)
        assert run.info.status == ("FAILED" if number == 6 else "FINISHED")
        assert run.data.metrics["est_speedup"] == pytest.approx(expected["est_speedup"])
        if math.isinf(expected["error"]):  # SQL stores keep +inf as float max
            assert run.data.metrics["error"] > 1e300
        else:
            assert run.data.metrics["error"] == pytest.approx(expected["error"])

    listed = {
        a.path
        for folder in ("policy", "tables", "plots")
        for a in client.list_artifacts(run_id, folder)
    }
    assert listed == {
        "policy/mlp.yaml",
        "tables/sensitivity.csv",
        "tables/trials.csv",
        "plots/pareto.png",
        "plots/layers.png",
    }
    down = workdir / "down"
    down.mkdir()
    policy_copy = Path(client.download_artifacts(run_id, "policy/mlp.yaml", str(down)))
    assert policy_copy.read_text() == POLICY_TEXT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no fingerprint: a hand-written policy
        assert load_policy(policy_copy).layers == {"fc1": "bf16"}
    trials_copy = Path(client.download_artifacts(run_id, "tables/trials.csv", str(down)))
    assert pd.read_csv(trials_copy)["number"].tolist() == list(range(N_TRIALS))
    png = Path(client.download_artifacts(run_id, "plots/pareto.png", str(down)))
    # the picture of this run's trials: the completed ones with a finite error (trial 5's is
    # inf, 6 failed), split at the budget, trial 3 chosen; pixel for pixel that figure
    fig = pareto_figure(fake_trials(), chosen_trial=3, budget=0.01)
    drawn = series(fig)
    point = {n: (trial_metrics(n)["error"], trial_metrics(n)["est_speedup"])
             for n in range(N_TRIALS)}
    assert drawn.pop("measured, feasible (5)") == [point[n] for n in range(5)]
    assert drawn.pop("measured, infeasible (1)") == [point[7]]  # error 0.016
    assert drawn.pop("chosen (trial 3)") == [point[3]]
    assert drawn.pop("budget 0.01")[0][0] == 0.01 and set(drawn) == {"measured front"}
    assert "1 measured with a non-finite error not shown" in fig.axes[0].get_title()
    ours = pareto_plot(fake_trials(), workdir / "ours.png", chosen_trial=3, budget=0.01)
    assert (matplotlib.image.imread(png) == matplotlib.image.imread(ours)).all()
    if uri is None:  # the documented local layout
        assert (workdir / "mlflow.db").is_file()
        assert any((workdir / "mlruns").rglob("mlp.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["server", "sqlite"])
def test_parallel_processes_keep_their_trials_apart(
    where: str, request: pytest.FixtureRequest, experiment: str, tmp_path: Path
) -> None:
    uri = request.getfixturevalue("mlflow_server_uri") if where == "server" else "-"
    if where == "sqlite":
        # Create the database once, as the first `tune` would, before the workers race.
        make_tracker(None, experiment, workdir=tmp_path)
    counts = {"a": 5, "b": 7}
    procs = {
        label: subprocess.Popen(
            [sys.executable, str(WORKER), uri, experiment, label, str(n), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for label, n in counts.items()
    }
    run_ids = {}
    for label, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        run_ids[label] = out.strip().splitlines()[-1]

    tracking_uri = uri if where == "server" else f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    for label, run_id in run_ids.items():
        kids = children(client, experiment_id, run_id)
        assert len(kids) == counts[label]
        assert {run.data.tags["worker"] for run in kids} == {label}
        assert sorted(int(run.data.tags["autoprec.trial"]) for run in kids) == list(
            range(counts[label])
        )
        assert client.get_run(run_id).data.params["worker"] == label


def test_unreachable_server_fails_fast_with_the_uri(closed_port: int, experiment: str) -> None:
    uri = f"http://127.0.0.1:{closed_port}"
    began = time.monotonic()
    with pytest.raises(TrackingError, match=uri.replace(".", r"\.")) as info:
        make_tracker(uri, experiment)
    assert time.monotonic() - began < 10
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)


def test_unreachable_database_fails_fast_without_the_password(
    closed_port: int, experiment: str
) -> None:
    pytest.importorskip("psycopg2")
    uri = f"postgresql+psycopg2://autoprec:hunter2@127.0.0.1:{closed_port}/mlflow"
    began = time.monotonic()
    with pytest.raises(TrackingError, match="cannot connect") as info:
        make_tracker(uri, experiment)
    assert time.monotonic() - began < 10  # MLflow alone retries for minutes
    assert "hunter2" not in str(info.value) and "autoprec:***@127.0.0.1" in str(info.value)


def test_unusable_store_is_a_tracking_error(tmp_path: Path, experiment: str) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the database's folder should be")
    uri = f"sqlite:///{blocker}/mlflow.db"
    with pytest.raises(TrackingError, match="not-a-dir"):
        make_tracker(uri, experiment)


@pytest.mark.slow
def test_server_dying_mid_run_never_raises(
    throwaway_mlflow_server, experiment: str, tmp_path: Path
) -> None:
    tracker = make_tracker(throwaway_mlflow_server.uri, experiment)
    run_id = tracker.start("tune-doomed", {"budget": 0.01}, {})
    tracker.log_trial(0, trial_params(0), trial_metrics(0))
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY_TEXT)
    throwaway_mlflow_server.stop()

    began = time.monotonic()
    with pytest.warns(TrackingWarning, match="stopped") as caught:
        for number in range(1, 4):
            tracker.log_trial(number, trial_params(number), trial_metrics(number))
        tracker.log_metrics({"error": 0.003})
        tracker.set_tags({"x": "y"})
        tracker.log_artifact(policy, "policy")
        log_tune_artifacts(
            tracker,
            policy_path=policy,
            sensitivity=None,
            trials=fake_trials(),
            layers={"fc1": "bf16"},
            chosen_trial=0,
            workdir=tmp_path,
        )
        tracker.finish("FINISHED")
    assert time.monotonic() - began < 30
    assert len([w for w in caught if issubclass(w.category, TrackingWarning)]) == 1
    assert not tracker.enabled and tracker.run_id == run_id


def test_no_track_is_a_null_tracker(tmp_path: Path) -> None:
    tracker = make_tracker("http://127.0.0.1:1", "never-contacted", enabled=False)
    assert isinstance(tracker, NullTracker) and not tracker.enabled
    assert tracker.start("x", {"a": 1}, {}) is None
    tracker.log_trial(0, {"fc1": "bf16"}, {"error": 0.1})
    tracker.log_metrics({"error": 0.1})
    tracker.set_tags({"a": "b"})
    tracker.log_artifact(tmp_path / "missing.yaml")
    log_tune_artifacts(
        tracker,
        policy_path=tmp_path / "missing.yaml",
        sensitivity=None,
        trials=fake_trials(),
        layers={},
        chosen_trial=None,
        workdir=tmp_path / "report",
    )
    tracker.finish("KILLED")
    assert not (tmp_path / "report").exists()
    with pytest.raises(ValueError, match="finish status"):
        tracker.finish("DONE")


@pytest.mark.slow
def test_tracker_context_manager_marks_a_crash_failed(
    mlflow_server_uri: str, experiment: str
) -> None:
    tracker = make_tracker(mlflow_server_uri, experiment)
    with pytest.raises(ZeroDivisionError), tracker:
        run_id = tracker.start("tune-crash", {}, {})
        _ = 1 / 0
    assert MlflowClient(tracker.uri).get_run(run_id).info.status == "FAILED"
