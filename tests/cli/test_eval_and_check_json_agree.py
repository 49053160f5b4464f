"""``eval --json`` and ``check --json`` agree: ``reasons`` is a list of ``{"layer",
"reason"}`` in both, ``feasible`` follows one rule (autoprec.evaluation.json_fields), ``est_speedup``
is null where the target cannot run the policy."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from autoprec.evaluation.json_fields import Reason, feasible, number, reasons_json, speedup
from tests.helpers import ROOT, run_cli

MLP = ROOT / "tests" / "check" / "fixtures" / "mlp_model.py"


@pytest.fixture
def model_py(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    shutil.copy(MLP, path)
    return path


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code, out, err = run_cli([*argv, "--json"], capsys, quiet_warnings=True)
    assert out.strip(), err
    return code, json.loads(out)


def _policy(tmp_path: Path, layers: str, budget: float | None = None) -> Path:
    path = tmp_path / "p.yaml"
    metrics = "" if budget is None else f"metrics: {{budget: {budget}}}\n"
    path.write_text(f"autoprec_policy: 1\ndefault: fp32\nlayers: {layers}\n{metrics}")
    return path


def _both(capsys, model_py: Path, policy: Path, *extra: str) -> tuple[dict, dict]:
    _, ev = _json(capsys, "eval", str(model_py), "--policy", str(policy), *extra)
    _, ch = _json(capsys, "check", str(model_py), "--policy", str(policy), *extra)
    return ev, ch


def _same_shape(ev: dict, ch: dict) -> None:
    for s in (ev, ch):
        assert isinstance(s["reasons"], list)
        assert all(set(r) == {"layer", "reason"} for r in s["reasons"])
    assert ev["feasible"] == ch["feasible"]
    assert (ev["est_speedup"] is None) == (ch["est_speedup"] is None)


def test_an_overflowing_policy(model_py: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "variant.txt").write_text("overflow")
    ev, ch = _both(capsys, model_py, _policy(tmp_path, "{fc1: fp16}", budget=0.01))
    _same_shape(ev, ch)
    assert ev["error"] == ch["error"] == "inf"
    assert ev["feasible"] is False and ch["passed"] is False
    assert ev["reasons"] and ch["reasons"][0]["layer"] == "fc1"


def test_inf_error_without_a_budget_is_not_feasible(model_py: Path, tmp_path: Path,
                                                    capsys) -> None:
    (tmp_path / "variant.txt").write_text("overflow")
    _, ev = _json(capsys, "eval", str(model_py), "--policy",
                  str(_policy(tmp_path, "{fc1: fp16}")))
    assert ev["error"] == "inf" and ev["budget"] is None
    assert ev["feasible"] is False
    assert "non-finite" in ev["reasons"][0]["reason"]


def test_a_finite_error_without_a_budget_is_unknown(model_py: Path, tmp_path: Path,
                                                    capsys) -> None:
    _, ev = _json(capsys, "eval", str(model_py), "--policy",
                  str(_policy(tmp_path, "{fc1: fp16}")))
    assert isinstance(ev["error"], float) and ev["feasible"] is None and ev["reasons"] == []


def test_a_target_that_cannot_run_the_policy(model_py: Path, tmp_path: Path, capsys) -> None:
    ev, ch = _both(capsys, model_py, _policy(tmp_path, "{fc1: bf16}", budget=0.5),
                   "--target", "t4")
    _same_shape(ev, ch)
    assert ev["est_speedup"] is None and ch["est_speedup"] is None
    assert ev["feasible"] is False and ch["feasible"] is False
    assert {r["layer"] for r in ev["reasons"]} == {r["layer"] for r in ch["reasons"]} == {"fc1"}


def test_a_feasible_policy(model_py: Path, tmp_path: Path, capsys) -> None:
    ev, ch = _both(capsys, model_py, _policy(tmp_path, "{fc1: fp16, fc2: fp16}", budget=0.5),
                   "--target", "t4")
    _same_shape(ev, ch)
    assert ev["feasible"] is True and ch["passed"] is True
    assert ev["reasons"] == ch["reasons"] == []
    assert ev["est_speedup"] == pytest.approx(ch["est_speedup"], rel=1e-3)


def test_the_rule() -> None:
    assert feasible(0.001, 0.01) is True
    assert feasible(0.02, 0.01) is False
    assert feasible(0.001, None) is None
    assert feasible(math.inf, None) is False and feasible(math.nan, 1.0) is False
    assert feasible(0.001, 0.01, runnable=False) is False
    assert feasible(0.001, 0.01, audit_ok=False) is False
    assert feasible(None, 0.01) is False  # not evaluated
    assert speedup(2.345678, runnable=True) == 2.3457 and speedup(0.0, runnable=True) is None
    assert speedup(2.0, runnable=False) is None
    assert number(math.inf) == "inf" and number(-math.inf) == "-inf" and number(1.5) == 1.5
    assert reasons_json(["whole model", Reason("one layer", "fc1")]) == [
        {"layer": None, "reason": "whole model"}, {"layer": "fc1", "reason": "one layer"}]
    import pickle

    r = pickle.loads(pickle.dumps(Reason("x", "fc1")))
    assert r == "x" and r.layer == "fc1"
