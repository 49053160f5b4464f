"""End to end: ``tune`` on a 3-layer MLP, tracked in a real loopback ``mlflow server``.

A fresh client then finds the parent run, one child run per trial with its metrics, and
the policy artifact, which loads and applies to the model.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from autoprec.track import make_tracker
from autoprec.tuning.tune import tune

MODEL = Path(__file__).parent / "fixtures" / "mlp3.py"
TRIALS = 6


@pytest.mark.slow
def test_tune_is_tracked_end_to_end(
    mlflow_server_uri: str, experiment: str, tmp_path: Path
) -> None:
    from autoprec.apply.apply import apply_policy
    from autoprec.policy import load_policy
    from autoprec.workload.loading import load_model_file

    tracker = make_tracker(mlflow_server_uri, experiment, workdir=tmp_path)
    out = tmp_path / "policies" / "mlp3.yaml"
    result = tune(MODEL, trials=TRIALS, seed=0, out=out, tracker=tracker, progress=False,
                  batch_size=65536)
    assert tracker.enabled, "tracking stopped during tune"

    client = MlflowClient(mlflow_server_uri)
    parent = client.get_run(tracker.run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["autoprec.study"] == result.search.study_name
    assert "autoprec.storage" in parent.data.tags
    assert {"budget", "target", "seed", "fingerprint"} <= set(parent.data.params)
    assert "est_speedup" in parent.data.metrics

    kids = client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{tracker.run_id}'",
        max_results=1000,
    )
    assert len(kids) == result.search.trials >= 1  # every trial this run made, measured or pruned
    for run in kids:
        if run.data.tags.get("autoprec.state") == "PRUNED":
            assert run.data.tags["autoprec.skipped"]
            continue
        assert {"calibration_error", "est_speedup"} <= set(run.data.metrics)
        assert run.data.params  # the trial's assignment: layer -> precision

    artifact = parent.data.tags["autoprec.policy_artifact"]
    assert artifact == f"policy/{out.name}"
    local = Path(client.download_artifacts(tracker.run_id, artifact, str(tmp_path / "down")))
    assert local.read_text() == out.read_text()
    plots = {a.path for a in client.list_artifacts(tracker.run_id, "plots")}
    assert plots == {"plots/pareto.png", "plots/layers.png"}

    spec = load_model_file(MODEL)
    model = spec.model()
    batch = spec.calibration_batches()[0]
    reference = model(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. a rule on a module with no GEMM
        policy = load_policy(local, model)
        with apply_policy(model, policy):
            lowered = model(batch)
    assert lowered.shape == reference.shape and torch.isfinite(lowered).all()
