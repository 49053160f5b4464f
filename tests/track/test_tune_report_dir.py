"""``tune --report DIR``: the plots outside MLflow, for the user's own
model — the tuned plan beside one global autocast per precision, and the per-layer map."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers import TRAP, run_cli


def test_report_dir_holds_the_tables_and_plots(tmp_path: Path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "report"
    code, out, err = run_cli(["tune", TRAP, "--no-track", "--quiet", "--batch-size", "65536",
                              "--precisions", "bf16,fp16", "--out", tmp_path / "p.yaml",
                              "--report", report], capsys)
    assert code == 0, err
    names = {p.name for p in report.iterdir()}
    assert {"baselines.csv", "baselines.png", "layers.png", "pareto.png", "trials.csv"} <= names
    rows = list(csv.DictReader((report / "baselines.csv").open()))
    assert [r["plan"] for r in rows] == [
        "tuned", "fp32 (no autocast)", "bf16 (one global autocast)", "fp16 (one global autocast)",
        "bf16 (model.to(bfloat16))", "fp16 (model.to(float16))"]
    assert float(rows[2]["error"]) > 0.01  # bf16 drowns `offset`'s signal: over budget
    assert float(rows[4]["error"]) > 0.01  # in the deploy form too
    assert rows[3]["error"] == "inf"  # fp16 overflows `blow`
    assert rows[5]["error"] == "inf"
    assert f"report: {report}/" in out


def test_report_dir_is_checked_before_any_work(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("not a folder")
    code, _, err = run_cli(["tune", TRAP, "--no-track", "--quiet", "--report",
                            tmp_path / "file"], capsys)
    assert code == 2 and "--report" in err and "is not a directory" in err
