"""tune's other modes: a Pareto front, export from a stored study, --train-aware."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoprec.errors import InputError
from autoprec.policy import load_policy
from autoprec.tuning.tune import tune
from tests.helpers import TRAP, run_cli

TRAINABLE = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, 16))

def _data(seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(16, 256, generator=g) for _ in range(4)]
    return [(x, (x[:, :4].sum(1) > 0).long()) for x in xs]

def calibration_data():
    return _data(1)

def forward(model, batch):
    return model(batch[0])

def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])
'''


def test_pareto_writes_one_policy_per_front_point(tmp_path: Path):
    out = tmp_path / "trap.yaml"
    res = tune(TRAP, max_error=0.01, precisions=["bf16", "fp16"], batch_size=65536, trials=8,
               pareto=True, out=out, progress=False)
    assert res.plan.front and len(res.plan.front) == len(res.plan.front_paths)
    points = [(p.metrics["calibration_error"], p.metrics["est_speedup"]) for p in res.plan.front]
    # non-dominated: sorted by speed-up descending, the error strictly falls
    points.sort(key=lambda e: -e[1])
    assert all(a[0] > b[0] for a, b in zip(points, points[1:]))
    for path in res.plan.front_paths:
        assert load_policy(path).metrics["budget"] == 0.01
    assert res.feasible and load_policy(out).metrics["error"] <= 0.01


def test_export_writes_the_policy_of_a_stored_study(tmp_path: Path, capsys):
    db = f"sqlite:///{tmp_path / 'study.db'}"
    res = tune(TRAP, max_error=0.01, precisions=["bf16", "fp16"], batch_size=65536, trials=6,
               storage=db, study_name="s", out=tmp_path / "tuned.yaml", progress=False)
    code, _, err = run_cli(["export", "--storage", db, "--study-name", "s", "--out",
                            tmp_path / "exported.yaml"], capsys)
    assert code == 0, err
    exported = load_policy(tmp_path / "exported.yaml")
    assert exported.layers == res.policy.layers
    assert exported.model["fingerprint"] == res.policy.model["fingerprint"]
    code, _, err = run_cli(["export", "--storage", db, "--study-name", "nope", "--out",
                            tmp_path / "x.yaml"], capsys)
    assert code == 2 and "no study named 'nope'" in err


def test_train_aware_checks_training_fidelity(tmp_path: Path):
    model = tmp_path / "model.py"
    model.write_text(TRAINABLE)
    res = tune(model, max_error=0.05, precisions=["bf16", "fp16"], batch_size=65536,
               trials=4, out=tmp_path / "p.yaml", progress=False, train_aware=True)
    pol = load_policy(res.path)
    assert pol.layers or pol.default != "fp32"  # lowered; fp32-vs-policy training agreed
    # the written plan passed the short-run contract (autoprec.training.short_run), and so did the
    # one global bf16 autocast it was weighed against
    assert pol.metrics["train_check_passed"] is True
    assert abs(pol.metrics["train_loss_gap"]) <= pol.metrics["max_loss_gap"] == 0.01
    bf16 = next(r for r in res.plan.speed.rows if r.name.startswith("bf16 (one global"))
    assert bf16.why_not == "" or bf16.why_not.startswith("short run:")
    assert res.feasible


def test_train_aware_needs_a_loss():
    with pytest.raises(InputError, match="needs loss"):
        tune(TRAP, train_aware=True, trials=1, progress=False)
