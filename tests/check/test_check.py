"""``autoprec check``: the gate passes a sound policy and fails, with the reason, on an
overflowing model, a changed model, an unrunnable precision and a tighter budget."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from autoprec.errors import InputError, PolicyError
from autoprec.evaluation.check import check
from autoprec.policy import Policy
from autoprec.trace.graph import fingerprint
from autoprec.workload.loading import load_model_file
from tests.helpers import CLI, ROOT, run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "mlp_model.py"


@pytest.fixture
def model_py(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    shutil.copy(FIXTURE, path)
    return path


def _variant(model_py: Path, name: str) -> None:
    (model_py.parent / "variant.txt").write_text(name)


def _policy(model_py: Path, target: str | dict = "t4", budget: float = 0.01, **extra) -> Path:
    """What tune writes for this model: fp16 hidden layers, its fingerprint, a budget."""
    fp = fingerprint(load_model_file(model_py).model())
    layers = extra.pop("layers", {"fc1": "fp16", "fc2": "fp16"})
    pol = Policy(default="fp32", layers=layers, model={"name": "check_mlp", "fingerprint": fp},
                 target=target if isinstance(target, dict) else {"device": target,
                                                                 "batch_size": 16},
                 metrics={"error": 0.0004, "budget": budget, "est_speedup": 1.0,
                          "feasible": True}, **extra)
    return pol.save(model_py.parent / "policy.yaml")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    """``check ARGV --json``: (exit code, the parsed report or {}, stderr)."""
    code, out, err = run_cli(["check", *argv, "--json"], capsys, quiet_warnings=True)
    return code, json.loads(out) if out.strip() else {}, err


def test_passes_a_policy_within_budget(model_py: Path, capsys) -> None:
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(_policy(model_py)))
    assert code == 0
    assert out["passed"] is True and out["reasons"] == []
    assert 0 < out["error"] < out["budget"] == 0.01
    assert out["feasible"] is True and out["fingerprint_match"] is True
    assert out["target"] == "t4" and out["batch_size"] == 16
    assert isinstance(out["est_speedup"], float)
    rows = {r["layer"]: r for r in out["layers"]}
    assert {k: (r["precision"], r["computed"]) for k, r in rows.items()} == {
        "fc1": ("fp16", "fp16"), "fc2": ("fp16", "fp16"), "head": ("fp32", "fp32")}


def test_fails_when_edited_weights_overflow_fp16(model_py: Path, capsys) -> None:
    policy = _policy(model_py)
    _variant(model_py, "overflow")  # same structure, fc1's weights x 1e5
    code, out, err = _cli(capsys, str(model_py), "--policy", str(policy))
    assert code == 1
    assert out["passed"] is False and out["error"] == "inf" and out["feasible"] is False
    assert out["fingerprint_match"] is True  # the structure did not change: the values did
    (reason,) = out["reasons"]
    assert reason["layer"] == "fc1"
    reason = reason["reason"]
    assert "non-finite" in reason and "'fc1' (fp16)" in reason and "65504" in reason
    assert "check failed" in err and "'fc1'" in err


def test_fails_on_a_structurally_changed_model(model_py: Path, capsys) -> None:
    policy = _policy(model_py)
    _variant(model_py, "wider")  # fc1: 32 -> 48 hidden units
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(policy))
    assert code == 1 and out["passed"] is False
    assert out["fingerprint_match"] is False
    assert any("model changed" in r["reason"] and "fingerprint" in r["reason"]
               and r["layer"] is None for r in out["reasons"])
    assert isinstance(out["error"], float)  # evaluated anyway (loaded with force)
    # --force accepts the change: the gate then judges the numbers only.
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(policy), "--force")
    assert code == 0 and out["passed"] is True
    assert any("accepted (--force)" in n for n in out["notes"])


def test_fails_when_a_rule_no_longer_fits_the_changed_model(model_py: Path, capsys) -> None:
    policy = _policy(model_py, layers={"fc1": "fp16", "fc2": "fp16"})
    text = policy.read_text().replace("fc2: fp16", "fc3: fp16")  # a layer "renamed" since
    # ... with the fingerprint of a model that had fc3: the model changed, exit 1.
    # (a well-formed fingerprint, 64 hex digits, of another model)
    policy.write_text(re.sub(r"fingerprint: sha256:[0-9a-f]{64}", "fingerprint: sha256:" + "0" * 64, text))
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(policy))
    assert code == 1
    assert any("no longer fits" in r["reason"] and "fc3" in r["reason"] for r in out["reasons"])
    assert out["error"] is None  # nothing to evaluate


def test_fails_when_the_target_cannot_run_a_precision(model_py: Path, capsys) -> None:
    policy = _policy(model_py, target="t4", layers={"fc1": "bf16"})
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(policy))
    assert code == 1 and out["feasible"] is False
    assert out["est_speedup"] is None  # no speed to estimate where it cannot run
    (reason,) = out["reasons"]
    assert reason["layer"] == "fc1"
    assert "t4 cannot run bf16" in reason["reason"] and "'fc1'" in reason["reason"]
    assert {r["layer"]: r["supported"] for r in out["layers"]}["fc1"] is False
    # The same policy on a device with bf16 passes.
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(policy), "--target", "a100")
    assert code == 0 and out["target"] == "a100"


def test_budget_given_overrides_the_policys(model_py: Path, capsys) -> None:
    policy = _policy(model_py)
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(policy), "--max-error", "1e-7")
    assert code == 1 and out["budget"] == 1e-7 and out["budget_source"] == "argument"
    assert "> budget 1e-07" in out["reasons"][0]["reason"]


def test_bad_input_is_exit_2(model_py: Path, capsys) -> None:
    policy = _policy(model_py)
    code, _, _ = run_cli(["check", model_py, "--policy", policy, "--max-error", "0.1",
                          "--max-drop", "0.1"], capsys)
    assert code == 2
    with pytest.raises(InputError, match="metric"):
        check(model_py, policy, max_drop=0.01)  # model.py has no metric
    bad = policy.parent / "bad.yaml"
    bad.write_text(policy.read_text().replace("fc2: fp16", "fc9: fp16"))  # same fingerprint
    with pytest.raises(PolicyError, match="fc9"):
        check(model_py, bad)


def test_text_output(model_py: Path, capsys) -> None:
    policy = _policy(model_py)
    code, out, _ = run_cli(["check", model_py, "--policy", policy], capsys,
                           quiet_warnings=True)
    assert code == 0 and "PASSED" in out and "fc1" in out


def test_passes_a_freshly_tuned_policy(model_py: Path, capsys) -> None:
    from autoprec.tuning.tune import tune

    res = tune(model_py, max_error=0.01, target="t4", precisions=["fp32", "fp16"], trials=4,
               out=model_py.parent / "tuned.yaml", progress=False)
    assert res.feasible
    code, out, _ = _cli(capsys, str(model_py), "--policy", str(res.path))
    assert code == 0, out["reasons"]
    assert out["budget"] == 0.01 and out["budget_source"] == "policy"
    assert out["fingerprint_match"] is True


def test_text_output_says_each_reason_and_note_once(model_py: Path) -> None:
    """As a user sees it: a real process, Python's own warning display included."""
    import subprocess

    path = model_py.parent / "hand.yaml"  # hand-written: no fingerprint, a note
    path.write_text("autoprec_policy: 1\ndefault: fp32\nlayers: {fc1: fp16}\n")
    _variant(model_py, "overflow")
    run = subprocess.run([*CLI, "check", str(model_py), "--policy", str(path), "--target",
                          "t4"], capture_output=True, text=True, cwd=model_py.parent,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    both = run.stdout + run.stderr
    assert run.returncode == 1, both
    assert "FAILED" in run.stdout and both.count("non-finite output values") == 1
    assert both.count("fingerprint") == 1, both


def test_compile_mode_from_the_policy_or_the_flag(model_py: Path, capsys) -> None:
    code, eager, _ = _cli(capsys, str(model_py), "--policy", str(_policy(model_py)))
    assert code == 0 and eager["mode"] == "eager"
    code, flag, _ = _cli(capsys, str(model_py), "--policy", str(_policy(model_py)), "--compile")
    assert code == 0 and flag["mode"] == "compile"
    # fused casts: the per-leaf fp16 plan costs less compiled than op by op
    assert flag["est_speedup"] > eager["est_speedup"]
    assert flag["breakdown"]["kernels"] < eager["breakdown"]["kernels"]
    policy = _policy(model_py, target={"device": "t4", "batch_size": 16, "mode": "compile"})
    code, recorded, _ = _cli(capsys, str(model_py), "--policy", str(policy))
    assert code == 0 and recorded["mode"] == "compile"
    assert recorded["est_speedup"] == flag["est_speedup"]
    code, back, _ = _cli(capsys, str(model_py), "--policy", str(policy), "--eager")
    assert back["mode"] == "eager" and back["est_speedup"] == eager["est_speedup"]
