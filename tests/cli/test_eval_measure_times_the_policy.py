"""``autoprec eval --measure`` times fp32 and the policy on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoprec.policy import Policy
from tests.helpers import TRAP, run_cli


def test_eval_measure_times_the_policy_beside_its_baselines_on_a_local_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pol = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"head": "bf16"}, metrics={"budget": 0.01}).save(pol)
    code, printed, err = run_cli(["eval", TRAP, "--policy", pol, "--target", "cpu", "--measure",
                                  "--json"], capsys)
    assert code == 0, err
    out = json.loads(printed)
    m = out["measured"]
    assert m["device"] == "cpu" and m["batch_size"] == 32 and m["rounds"] >= 7
    assert m["p10"] <= m["speedup"] <= m["p90"]
    assert "calibrated the cpu profile on this machine" in out["speed_source"]
    rows = {r["name"]: r for r in out["baselines"]["rows"]}
    assert rows["policy"]["measured_speedup"] == m["speedup"]
    assert rows["fp32 (no autocast)"]["measured_speedup"] == 1.0
    assert rows["bf16 (one global autocast)"]["error"] > 0.01  # trap: bf16 loses offset
    assert not rows["bf16 (one global autocast)"]["feasible"]
    assert rows["tf32 (global flag)"]["why_not"] == "not on cpu"
    assert (tmp_path / ".autoprec" / "calibration").is_dir()  # cached beside the policy


@pytest.mark.slow
def test_eval_measure_of_a_compiled_deployment_times_the_rows_compiled(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``--compile`` (or ``target.mode: compile``): priced on this machine's compiled
    calibration (seeded here, not measured: minutes of compiling) and timed compiled."""
    from autoprec.cost import Calibration, get_profile
    from autoprec.measure.machine import calibration_path, this_machine

    m = this_machine("cpu")
    Calibration(device="cpu", machine=m.to_dict(), mode="compile", call_overhead_s=30e-6).save(
        calibration_path(tmp_path / ".autoprec" / "calibration", get_profile("cpu"), m,
                         "compile"))
    pol = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"head": "bf16"}, metrics={"budget": 0.01}).save(pol)
    code, printed, err = run_cli(["eval", TRAP, "--policy", pol, "--target", "cpu", "--measure",
                                  "--compile", "--json"], capsys)
    assert code == 0, err
    out = json.loads(printed)
    assert out["mode"] == "compile"
    assert "compiled micro-benchmarks" in out["speed_source"]
    assert "torch.compile'd" in out["measured"]["timing"]
    assert out["measured"]["rounds"] >= 7


def test_eval_of_a_remote_target_prints_the_baselines_estimated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pol = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"head": "bf16"}, metrics={"budget": 0.01}).save(pol)
    code, text, err = run_cli(["eval", TRAP, "--policy", pol, "--target", "h100", "--measure"],
                              capsys)
    assert code == 0, err
    for name in ("policy", "fp32 (no autocast)", "bf16 (one global autocast)",
                 "fp16 (one global autocast)", "tf32 (global flag)"):
        assert name in text
    assert "no h100 here" in text and "not measured" in text
    assert "pick: " in text


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path, capsys):
    bad = tmp_path / "dup.yaml"
    bad.write_text("autoprec_policy: 1\ndefault: fp32\nlayers:\n  blow: bf16\n  blow: fp16\n")
    code, _, err = run_cli(["show", bad], capsys)
    assert code == 2 and f"{bad}:5:3" in err and "'blow' given twice" in err, err
