"""A training tune (--train-aware) on real models: the gradient probes' exclusions and
notes reach the policy before anything trains, the written plan passes the short-run
contract, and a checked one-liner as fast as the tuned plan is written instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoprec.evaluation.decision import SAME_SPEED
from autoprec.plan import compile_plan
from autoprec.policy import load_policy
from autoprec.tuning.tune import tune

HAZARD = Path(__file__).resolve().parents[2] / "examples" / "grad_hazard" / "model.py"

PRECISE = '''
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
TEACHER = torch.randn(256, 1024)

def build_model():
    # started next to its exact solution: fp32 drives the loss to ~0, bf16's rounding
    # leaves ~1e-4 in every output
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(1024, 256, bias=False))
    with torch.no_grad():
        m[0].weight.copy_(TEACHER + 1e-3 * torch.randn(256, 1024))
    return m.eval()

def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [(x, x @ TEACHER.T) for x in (torch.randn(64, 1024, generator=g) for _ in range(n))]

def calibration_data():
    return _data(2, 3)

def eval_data():
    return _data(3, 2)

def forward(model, batch):
    return model(batch[0])

def loss(outputs, batch):
    return F.mse_loss(outputs.float(), batch[1])
'''


def _tune(model: Path, tmp_path: Path, **kw):
    opts = dict(max_error=0.05, target="h100", batch_size=65536, trials=6,
                out=tmp_path / "p.yaml", progress=False, train_aware=True, train_lr=1e-3,
                train_steps=12)
    opts.update(kw)
    return tune(model, **opts)


def _no_faster_checked_one_liner(res) -> None:
    written = res.policy.metrics["est_speedup"]
    for r in res.plan.speed.rows:
        if r.role == "baseline" and r.feasible and r.est_speedup is not None:
            assert r.est_speedup <= written * (1 + SAME_SPEED), (r.name, r.est_speedup)


def test_hazard_layer_is_named_and_the_plan_records_the_scaler(tmp_path: Path):
    res = _tune(HAZARD, tmp_path, precisions=["fp16", "bf16"])
    sens = res.search.sensitivity.set_index(["layer", "precision"])
    assert "needs the GradScaler" in sens.loc[("branch", "fp16"), "reason"]
    pol = load_policy(res.path)
    assert "needs the GradScaler" in pol.reasons["branch"]
    assert not any("GradScaler" in why for lay, why in pol.reasons.items() if lay != "branch")
    assert pol.metrics["train_check_passed"] is True
    assert res.train_check.verdicts and res.train_check.verdicts[0]["rule"].startswith("after 12 steps")
    _no_faster_checked_one_liner(res)


def test_a_layer_whose_gradients_flush_even_scaled_never_gets_fp16(tmp_path: Path):
    model = tmp_path / "model.py"
    model.write_text(HAZARD.read_text().replace("GAMMA_INIT = 1e-6", "GAMMA_INIT = 1e-12"))
    res = _tune(model, tmp_path, precisions=["fp16"])
    pol = load_policy(res.path)
    assert "even with loss scale 65536" in pol.reasons["branch"]
    net = _model(model)
    assert compile_plan(pol, net).assignment(["branch"])["branch"] != "fp16"


def test_a_plan_that_does_not_train_like_fp32_is_not_written(tmp_path: Path):
    model = tmp_path / "model.py"
    model.write_text(PRECISE)
    res = _tune(model, tmp_path, precisions=["bf16"])
    bf16 = next(r for r in res.plan.speed.rows if r.name.startswith("bf16 (one global"))
    assert not bf16.feasible and bf16.why_not.startswith("short run: eval loss")
    tuned = res.plan.speed.rows[0]
    pol = load_policy(res.path)
    assert pol.metrics["train_check_passed"] is True
    assert "bf16" not in compile_plan(pol, _model(model)).used()
    assert not tuned.feasible or tuned.policy.default == "fp32"
    _no_faster_checked_one_liner(res)


def _model(path: Path):
    from autoprec.workload.loading import load_model_file

    return load_model_file(path).model()


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)  # the study database beside the policy, not in the repo


@pytest.mark.parametrize("flag, value", [("--max-loss-gap", "-1"), ("--train-steps", "0"),
                                         ("--train-lr", "nan")])
def test_bad_training_check_settings_are_one_line(flag, value, capsys):
    from tests.helpers import TRAP, run_cli

    code, _, err = run_cli(["tune", TRAP, "--train-aware", flag, value, "--no-track"], capsys)
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1


def test_a_one_liner_estimated_slower_than_a_tuned_plan_that_trains_is_not_trained():
    """Untimed rows: a one-liner estimated slower than the tuned plan (beyond SAME_SPEED)
    cannot be written (decision.one_liner_instead), so its short run is not paid for; one
    within SAME_SPEED of it is trained, as is every one-liner when no tuned plan passed."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from autoprec.evaluation.decision import one_liner_instead
    from autoprec.evaluation.rows import Row
    from autoprec.policy.build import policy_for
    from autoprec.training.short_run import ShortRunCheck
    from autoprec.tuning.train_choice import baseline_check

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 8))

    g = torch.Generator().manual_seed(0)
    batches = [(x, x[:, :8]) for x in (torch.randn(4, 16, generator=g) for _ in range(2))]
    check = ShortRunCheck(build, batches, lambda out, b: F.mse_loss(out.float(), b[1]),
                          forward=lambda m, b: m(b[0]), steps=2)
    est = {"bf16": 1.5, "fp16": 2.0 / (1 + SAME_SPEED / 2)}
    tuned = Row("tuned", "tuned", policy_for("fp32", {"0": "bf16"}), 0.0, True, 2.0)
    run = baseline_check(check, lambda pol: est[pol.default], tuned)
    why = run(policy_for("bf16", {}), "bf16 (one global autocast)")
    assert why.startswith("not training-checked: estimated 1.50x, slower than the tuned")
    assert check.verdicts() == []  # nothing trained, not even fp32's reference run
    assert run(policy_for("fp16", {}), "fp16 (one global autocast)") == ""  # within SAME_SPEED
    assert [v.run.label for v in check.verdicts()] == ["fp16 (one global autocast)"]
    # the skipped row could not have been written: the decision is the same without it
    rows = [tuned, Row("bf16", "baseline", policy_for("bf16", {}), 0.0, True, 1.5)]
    assert one_liner_instead(rows) is None
    # no tuned plan that trains: every one-liner is checked
    assert baseline_check(check, lambda pol: est[pol.default], None)(
        policy_for("bf16", {}), "bf16 (one global autocast)") == ""
