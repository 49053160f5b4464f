"""README claims about ``autoprec tune`` that had no test: ``--patience K``, ``--experiment
NAME`` (a real MLflow store, SQLite in tmp_path), ``--no-measure``, and the default output
``policies/<MODEL_NAME>-<target>.yaml`` when ``--out`` is left out. The enumeration bound
("spaces up to 2 M plans are enumerated") is tests/search/test_enumeration_bound.py.

The model (``EXACT``) scores 1 only when its outputs are fp32's bit for bit: with
``--max-drop 0.5`` every lowered plan is infeasible, and since a metric budget is not
predicted from the probes the walk measures candidates fastest first, none improving on the
last — the run that ``--patience`` must cut short.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoprec.policy import load_policy
from tests.helpers import run_cli

EXACT = '''
"""Three Linears (512 wide: at a large batch the GEMMs, not the casts, set the time);
the metric is 1 only where the outputs equal fp32's exactly."""
import torch
from torch import nn

MODEL_NAME = "exact"


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 16))


_REFERENCE = build_model().eval()  # a separate copy: no policy is ever applied to it


def calibration_data():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 32, generator=g) for _ in range(2)]


def metric(outputs, batch):
    with torch.no_grad():
        return float(torch.equal(outputs.float(), _REFERENCE(batch)))
'''

#: Options every run here shares: the stored h100 profile (nothing timed) at a batch where
#: lowered plans are faster (at the calibration batch, 4, every plan is launch-bound).
BASE = ["--target", "h100", "--batch-size", "65536", "--precisions", "bf16,fp16", "--quiet",
        "--json"]


@pytest.fixture()
def model_py(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"  # the file is model.py; the model's name is "exact"
    path.write_text(EXACT)
    return path


def _tune(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    """``tune ARGS --json``: (exit code, the summary); each test pins the code it sets up."""
    code, out, err = run_cli(["tune", *args], capsys)
    assert out.strip(), (code, err)
    return code, json.loads(out)


def _finished(storage: str, study: str) -> int:
    import optuna

    s = optuna.load_study(study_name=study, storage=storage)
    return sum(t.state == optuna.trial.TrialState.COMPLETE for t in s.trials)


@pytest.mark.parametrize("k", [3])
def test_patience_stops_after_k_trials_without_improvement(
        k: int, model_py: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = f"sqlite:///{tmp_path / f'p{k}.db'}"
    code, summary = _tune([str(model_py), *BASE, "--max-drop", "0.5", "--no-track",
                           "--trials", "20", "--patience", str(k), "--storage", storage,
                           "--study-name", "s", "--out", str(tmp_path / "p.yaml")], capsys)
    # every lowered plan drops the metric by 1: no trial is within budget, so the fp32
    # baseline (drop 0) is what is written, not the closest over-budget trial
    assert code == 0 and summary["feasible"] and summary["error"] == 0.0
    written = load_policy(tmp_path / "p.yaml")
    assert written.default == "fp32" and not written.layers
    assert summary["trials"] == k and not summary["search_complete"]
    assert _finished(storage, "s") == k  # each one measured, none improving on the last


def test_without_patience_the_same_search_goes_on(
        model_py: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The control: the search above has more than 3 plans to measure and stops only at
    ``--trials`` (so the patience runs stopped on patience, not for want of plans)."""
    storage = f"sqlite:///{tmp_path / 'all.db'}"
    code, summary = _tune([str(model_py), *BASE, "--max-drop", "0.5", "--no-track",
                           "--trials", "5", "--storage", storage, "--study-name", "s",
                           "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 0 and summary["trials"] == 5 and not summary["search_complete"]
    assert _finished(storage, "s") == 5


def test_default_output_is_policies_model_name_target(
        model_py: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, summary = _tune([str(model_py), *BASE, "--max-error", "0.05", "--no-track",
                           "--trials", "3"], capsys)
    assert code == 0, summary
    want = Path("policies") / "exact-h100.yaml"  # MODEL_NAME, not the file's name
    assert Path(summary["policy"]) == want and (work / want).is_file()
    assert load_policy(work / want).model["name"] == "exact"
    assert (work / "policies" / "studies").is_dir()  # the study beside it
    assert sorted(p.name for p in (work / "policies").glob("*.yaml")) == ["exact-h100.yaml"]


def test_experiment_names_the_mlflow_experiment_the_run_is_logged_in(
        model_py: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, summary = _tune([str(model_py), *BASE, "--max-error", "0.05", "--trials", "3",
                           "--mlflow-uri", uri, "--experiment", "precision-sweep",
                           "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 0, summary
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("precision-sweep")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id],
                              filter_string="tags.mlflow.parentRunId IS NULL")
    assert [r.info.run_id for r in runs] == [summary["mlflow_run"]]
    assert load_policy(tmp_path / "p.yaml").provenance["mlflow_run"] == summary["mlflow_run"]
    default = client.get_experiment_by_name("autoprec")  # the default name: not used
    assert default is None or not client.search_runs([default.experiment_id])


def test_no_measure_neither_calibrates_nor_times_on_the_local_target(
        model_py: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Target cpu is this machine: by default tune calibrates its profile here and times the
    winner (tests/tuning/test_confirm_speed.py); ``--no-measure`` prices on the stored
    profile and times nothing."""
    out = tmp_path / "p.yaml"
    code, summary = _tune([str(model_py), "--target", "cpu", "--precisions", "bf16",
                           "--quiet", "--json", "--max-error", "0.05", "--no-track",
                           "--trials", "3", "--no-measure", "--out", str(out)], capsys)
    assert code == 0, summary
    pol = load_policy(out)
    assert pol.provenance["speed_source"] == "stored profile"
    assert "measured_speedup" not in pol.metrics and summary["measured_speedup"] is None
    assert summary["baselines"] is None or not summary["baselines"].get("measured")
    assert not (tmp_path / ".autoprec" / "calibration").exists()  # nothing calibrated
