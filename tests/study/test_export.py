"""``autoprec export``: the policy of a stored study says what it is — a calibration-data
choice whose eval-data confirmation was not repeated — and records the torch it ran on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoprec.evaluation.check import check
from autoprec.policy import Policy, load_policy
from autoprec.study.export import EXPORT_NOTE
from tests.helpers import TRAP, run_cli


def test_tune_then_export(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = f"sqlite:///{tmp_path / 'study.db'}"
    tuned_path = tmp_path / "tuned.yaml"
    code, out, err = run_cli(["tune", TRAP, "--max-error", "0.01", "--precisions", "bf16,fp16",
                              "--batch-size", "65536", "--trials", "6", "--storage", db,
                              "--study-name", "s", "--out", tuned_path, "--no-track",
                              "--quiet"], capsys)
    assert code == 0, out + err
    # The summary is for people: the error rounded (the policy file keeps 6 digits).
    (line,) = [x for x in out.splitlines() if x.startswith("error ")]
    assert line.split()[1] == f"{load_policy(tuned_path).metrics['error']:.4g}", line
    assert "(budget 0.01)" in line
    code, _, err = run_cli(["export", "--storage", db, "--study-name", "s", "--out",
                            tmp_path / "exported.yaml"], capsys)
    assert code == 0, err
    tuned, exported = load_policy(tuned_path), load_policy(tmp_path / "exported.yaml")

    assert exported.layers == tuned.layers
    # metrics.error is the held-out error: the search confirmed the trial on the eval data
    # (it is stored on the trial), so export can say so; a trial never confirmed there gets
    # calibration_error only (EXPORT_NOTE).
    assert exported.metrics["error"] == tuned.metrics["error"]
    assert exported.metrics["calibration_error"] == tuned.metrics["calibration_error"]
    assert exported.metrics["budget"] == 0.01
    assert exported.provenance["torch"] == str(torch.__version__)
    assert exported.provenance["exported"] is True
    assert "confirmed on the eval data during the search" in exported.provenance["note"]
    assert "not repeated" in EXPORT_NOTE
    # ... and check confirms it on the eval data, with the recorded budget.
    res = check(TRAP, tmp_path / "exported.yaml")
    assert res.passed and res.budget_source == "policy" and res.budget == 0.01


METRIC_MODEL = '''
import torch

def build_model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 3)

def calibration_data():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(2)]

def metric(outputs, batch):
    return float((outputs.argmax(-1) == 0).float().mean())
'''


def test_an_exported_metric_drop_budget_stays_a_metric_drop(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(METRIC_MODEL)
    pol = Policy(default="fp32", layers={"": "bf16"},
                 metrics={"calibration_metric_drop": 0.0, "budget": 0.5, "feasible": True})
    res = check(model, pol)
    assert res.budget_kind == "max_drop" and res.budget == 0.5 and res.passed
