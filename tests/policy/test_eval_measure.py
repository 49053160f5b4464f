"""``autoprec eval --measure`` times fp32 and the policy on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoprec.cli.main import main
from autoprec.policy import Policy

TRAP = Path(__file__).resolve().parents[2] / "experiments" / "trap" / "model.py"


def test_eval_measure_reports_both_latencies(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pol = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"head": "bf16"}, metrics={"budget": 0.01}).save(pol)
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(TRAP), "--policy", str(pol), "--measure", "--json"])
    assert exc.value.code == 0
    out = json.loads(capsys.readouterr().out)
    m = out["measured"]
    assert m["device"] == "cpu" and m["fp32_ms"] > 0 and m["policy_ms"] > 0
    assert m["speedup"] == pytest.approx(m["fp32_ms"] / m["policy_ms"], rel=1e-2)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path, capsys):
    bad = tmp_path / "dup.yaml"
    bad.write_text("autoprec_policy: 1\ndefault: fp32\nlayers:\n  blow: bf16\n  blow: fp16\n")
    with pytest.raises(SystemExit) as exc:
        main(["show", str(bad)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{bad}:5:3" in err and "'blow' given twice" in err, err
