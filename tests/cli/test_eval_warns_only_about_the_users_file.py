"""`eval` warns about the policy file it was given, never about the baselines it builds in
memory (a tuned policy with a fingerprint got "model.fingerprint: missing … (normal for a
hand-written policy)" from its fp32 / one-liner rows)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helpers import ROOT
from tests.helpers import run_cli as run

MODEL = ROOT / "examples" / "mixed8" / "model.py"
POLICY = ROOT / "policies" / "mixed8-h100.yaml"


def test_eval_of_a_tuned_policy_prints_no_warning(capsys) -> None:
    code, out, err = run(["eval", MODEL, "--policy", POLICY], capsys)
    assert code == 0, err
    assert "warning" not in err, err
    assert "fp32 (no autocast)" in out  # the baselines were built and applied


def test_a_policy_without_fingerprint_is_warned_about_once_by_its_name(
        tmp_path: Path, capsys) -> None:
    data = yaml.safe_load(POLICY.read_text())
    del data["model"]["fingerprint"]
    hand = tmp_path / "hand.yaml"
    hand.write_text(yaml.safe_dump(data))
    code, _, err = run(["eval", MODEL, "--policy", hand], capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(hand) in warnings[0], warnings
    assert "<policy>" not in err
