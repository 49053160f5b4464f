"""``check --min-headroom``: the gate fails a plan whose 16-bit layer comes within the
given factor of its format's limit on calibration data, naming the layer; eval / check
--json report every low-precision layer's headroom (evaluation.headroom)."""

from __future__ import annotations

import json

import pytest

from autoprec.errors import InputError
from autoprec.evaluation.check import check
from tests.helpers import ROOT, run_cli

MODEL = ROOT / "examples" / "mixed8" / "model.py"
POLICY = ROOT / "examples" / "mixed8" / "guarded.yaml"  # wide1/wide2/tail1/tail2 fp16


def test_headroom_rows_and_the_gate() -> None:
    passed = check(MODEL, POLICY, min_headroom=100)
    assert passed.passed, passed.reasons
    rooms = {r["layer"]: r for r in passed.headroom}
    assert set(rooms) == {"embed", "wide1", "wide2", "range_block", "tail1", "tail2"}
    wide1 = rooms["wide1"]  # calibration max ~2.7: ~2.4e4x below 65504 (3e4x overflows it)
    assert wide1["format"] == "fp16" and wide1["limit"] == 65504.0
    assert 1e4 < wide1["headroom"] < 3e4
    assert rooms["embed"]["format"] == "bf16" and rooms["embed"]["headroom"] > 1e30
    failed = check(MODEL, POLICY, min_headroom=2e4)  # tail1's 1.5e4x is under it
    assert not failed.passed
    assert [r.layer for r in failed.reasons] == ["tail1"]
    assert "headroom 1.53e+04x < 20000 (--min-headroom) at layer 'tail1' (fp16)" in \
        failed.reasons[0]


def test_cli_gate_exits_1_and_json_carries_headroom(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    code, out, err = run_cli(["check", MODEL, "--policy", POLICY, "--min-headroom", "3e4",
                              "--json"], capsys, quiet_warnings=True)
    assert code == 1
    d = json.loads(out)
    assert d["min_headroom"] == 3e4 and not d["passed"]
    assert {r["layer"] for r in d["reasons"]} == {"wide1", "tail1", "tail2"}  # wide2 has more
    assert next(r for r in d["layers"] if r["layer"] == "wide1")["headroom"] < 3e4
    assert "headroom" in err and "\n" not in err.strip()


def test_min_headroom_must_be_positive() -> None:
    with pytest.raises(InputError, match="--min-headroom must be a finite number > 0"):
        check(MODEL, POLICY, min_headroom=0)
