"""One target, one price: tune, ``eval`` and ``check`` price a policy for the local CPU
from the same source (this machine's calibration and the model's ops timed here).

Last round ``check`` read the stored ``cpu`` profile where ``eval`` and tune used this
machine's calibration: 2.59x against 3.01x for one policy, target and batch. And a
training-form plan's step is priced with model.py's loss in all three
(``Target.plan_cost``): ``eval`` and ``check`` priced it without (GPT-2: 3.43x in eval,
3.01x in the tune that wrote the plan).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autoprec.evaluation.check import check
from autoprec.policy import load_policy
from autoprec.tuning.tune import tune
from tests.helpers import MODELS, run_cli

FIXTURE = MODELS / "mlp.py"


def test_tune_eval_and_check_print_one_price_for_the_local_cpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model.py"
    shutil.copy(FIXTURE, model)
    out = tmp_path / "policies" / "mlp-cpu.yaml"
    tune(model, max_error=0.05, target="cpu", precisions=["bf16", "fp16"], trials=4,
         out=out, progress=False)
    pol = load_policy(out)
    tuned = float(pol.metrics["est_speedup"])
    assert list((out.parent / ".autoprec" / "calibration").glob("ops-*.json"))

    code, text, err = run_cli(["eval", model, "--policy", out, "--json"], capsys)
    assert code == 0, err
    evaluated = json.loads(text)["est_speedup"]

    got = check(model, out)
    assert any("cpu profile calibrated on this machine" in n for n in got.notes), got.notes
    assert got.est_speedup == pytest.approx(evaluated, rel=1e-9)
    assert got.est_speedup == pytest.approx(tuned, rel=1e-3)  # the policy keeps 4 digits

    # without this machine's timings (another folder), check says it priced the stored
    # profile, measured on another machine
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(out, other / "p.yaml")
    far = check(model, other / "p.yaml")
    assert any("measured on another machine" in n for n in far.notes), far.notes


#: A classifier whose output (a 4096-way logit per row) is large beside its GEMMs, so that
#: the cross-entropy's forward and backward is a visible share of the step.
WIDE_LOGITS = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4096))

def calibration_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 4096, (32,), generator=g))
            for _ in range(2)]

def forward(model, batch):
    return model(batch[0])

def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])
'''


def _json(args: list[object], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli([*args, "--json"], capsys, quiet_warnings=True)
    assert code == 0, err
    return json.loads(out)


def test_tune_eval_and_check_print_one_price_for_a_training_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model = tmp_path / "model.py"
    model.write_text(WIDE_LOGITS)
    out = tmp_path / "p.yaml"
    common = ["--target", "h100", "--batch-size", "4096"]
    tuned = _json(["tune", model, *common, "--form", "train", "--max-error", "0.05",
                   "--precisions", "bf16", "--trials", "2", "--seed", "0", "--no-track",
                   "--quiet", "--out", out], capsys)
    policy = load_policy(out)
    assert policy.form == "train"
    est = policy.metrics["est_speedup"]
    evaluated = _json(["eval", model, "--policy", out, *common], capsys)
    checked = _json(["check", model, "--policy", out, *common, "--max-error", "0.05"], capsys)
    assert tuned["est_speedup"] == pytest.approx(est, rel=1e-3)
    assert evaluated["est_speedup"] == pytest.approx(est, rel=1e-3)
    assert checked["est_speedup"] == pytest.approx(est, rel=1e-3)
    assert checked["breakdown"].get("loss_us"), checked["breakdown"]  # priced, not nothing
