"""``autoprec eval`` of a training-form policy: the whole step priced (fprop / dgrad / wgrad /
casts / optimizer / scaler) and its memory, in the table and in ``--json``; on a local CPU
with ``--measure`` the rows are timed as real training steps."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from autoprec.cost.step import STEP_PARTS
from autoprec.policy import Policy, load_policy
from tests.helpers import run_cli

MODEL_PY = textwrap.dedent('''
    import torch
    from torch import nn
    import torch.nn.functional as F


    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))


    def calibration_data():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(16, 32, generator=g), torch.randint(0, 16, (16,), generator=g))]


    def forward(model, batch):
        return model(batch[0])


    def loss(outputs, batch):
        return F.cross_entropy(outputs.float(), batch[1])
''')


@pytest.fixture
def model_py(tmp_path: Path) -> Path:
    p = tmp_path / "model.py"
    p.write_text(MODEL_PY)
    return p


def test_eval_json_has_the_step_breakdown_and_memory(tmp_path: Path, model_py: Path,
                                                     capsys: pytest.CaptureFixture[str]):
    pol = tmp_path / "p.yaml"
    Policy(default="fp16", form="train", metrics={"budget": 0.05}).save(pol)
    code, printed, err = run_cli(["eval", model_py, "--policy", pol, "--target", "h100",
                                  "--batch-size", "4096", "--json"], capsys)
    assert code == 0, err
    out = json.loads(printed)
    b = out["breakdown"]
    for part in STEP_PARTS:
        assert f"{part}_us" in b
    assert b["dgrad_us"] > 0 and b["wgrad_us"] > 0 and b["scaler_us"] > 0  # fp16: GradScaler
    assert b["total_us"] == pytest.approx(sum(b[f"{p}_us"] for p in STEP_PARTS), rel=1e-3)
    assert b["backward_us"] > b["forward_us"]  # dgrad + wgrad: twice the forward's GEMMs
    assert {r["layer"]: r["computed"] for r in out["backward_audit"]} == {"0": "fp16",
                                                                          "3": "fp16"}
    assert out["audit_errors"] == []  # forward and backward: every rule ran
    mem = b["memory"]
    assert mem["optimizer_mb"] == pytest.approx(2 * mem["weights_mb"])
    rows = {r["name"]: r for r in out["baselines"]["rows"]}
    assert rows["policy"]["train_memory_bytes"] > 0
    assert rows["bf16 (model.to(bfloat16))"]["why_not"] == "--form train: it stores no fp32 masters"
    assert rows["bf16 (model.to(bfloat16))"]["est_speedup"] is None  # not priced: not 0x
    code, printed, err = run_cli(["eval", model_py, "--policy", pol, "--target", "h100",
                                  "--batch-size", "4096"], capsys)
    assert code == 0, err
    assert "est. training step: fprop" in printed and "est. training memory: peak" in printed
    assert "train memory" in printed
    stored = next(ln for ln in printed.splitlines() if ln.startswith("bf16 (model.to("))
    assert "0.00x" not in stored and "no fp32 masters" in stored


def test_eval_measure_times_training_steps_on_this_cpu(tmp_path: Path, model_py: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    pol = tmp_path / "p.yaml"
    Policy(default="bf16", form="train", metrics={"budget": 0.05}).save(pol)
    code, printed, err = run_cli(["eval", model_py, "--policy", pol, "--target", "cpu",
                                  "--measure", "--json"], capsys)
    assert code == 0, err
    out = json.loads(printed)
    assert "training steps (forward, loss, backward, AdamW" in out["measured"]["timing"]
    rows = {r["name"]: r for r in out["baselines"]["rows"]}
    assert rows["fp32 (no autocast)"]["measured_speedup"] == 1.0
    assert rows["fp16 (one global autocast)"]["measured_speedup"] is not None  # + GradScaler
    assert rows["bf16 (model.to(bfloat16))"]["measured_speedup"] is None  # does not train


def test_tune_memory_limit_binds_the_training_step(tmp_path: Path, model_py: Path,
                                                   capsys: pytest.CaptureFixture[str]):
    """--memory-limit 3 MB: above twice the weights (the up-front check passes), below fp32's
    training step at 4096 rows (3.8 MB, mostly saved activations) and above a 16-bit one's
    (2.4 MB): fp32 cannot train there, with the reason; the plan written fits."""
    out = tmp_path / "p.yaml"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, printed, err = run_cli(["tune", model_py, "--form", "train", "--target", "h100",
                                  "--batch-size", "4096", "--memory-limit", "0.003",
                                  "--max-error", "0.05", "--trials", "4", "--out", out,
                                  "--mlflow-uri", uri, "--quiet", "--json"], capsys)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(printed)["baselines"]["rows"]}
    assert "training memory 0.00 GB > --memory-limit 0.003 GB" in (
        rows["fp32 (no autocast)"]["why_not"])
    assert rows["fp32 (no autocast)"]["train_memory_bytes"] > 3e6
    from mlflow import MlflowClient

    from autoprec.policy import load_policy

    pol = load_policy(out)
    assert pol.metrics["est_train_peak_mb"] < 3.0
    assert pol.metrics["est_step_us"] == pytest.approx(sum(
        pol.metrics[f"est_{p}_us"] for p in STEP_PARTS), rel=1e-3)
    run = MlflowClient(uri).get_run(pol.provenance["mlflow_run"])  # the parent run
    assert run.data.metrics["est_train_peak_mb"] == pol.metrics["est_train_peak_mb"]
    assert run.data.metrics["est_step_us"] == pol.metrics["est_step_us"]


def test_compile_train_tune_prices_the_step(tmp_path: Path, model_py: Path,
                                            capsys: pytest.CaptureFixture[str]):
    """``tune --compile --form train``: the forward priced as torch.compile runs it and the
    backward, optimizer and scaler on top (cost.step.StepPart): the written policy's
    figures include the backward."""
    out = tmp_path / "p.yaml"
    code, printed, err = run_cli(["tune", model_py, "--form", "train", "--compile",
                                  "--target", "h100", "--batch-size", "4096", "--max-error",
                                  "0.05", "--no-track", "--quiet", "--out", out], capsys)
    assert code == 0, err
    pol = load_policy(out)
    assert pol.mode == "compile" and pol.form == "train"
    m = pol.metrics
    assert m["est_dgrad_us"] > 0 and m["est_wgrad_us"] > 0 and m["est_optimizer_us"] > 0
    assert m["est_step_us"] == pytest.approx(
        sum(m[f"est_{p}_us"] for p in STEP_PARTS), rel=1e-3)
    code, printed, err = run_cli(["eval", model_py, "--policy", out, "--target", "h100",
                                  "--batch-size", "4096", "--json"], capsys)
    assert code == 0, err
    b = json.loads(printed)["breakdown"]
    assert b["backward_us"] > 0 and b["dgrad_us"] > 0
