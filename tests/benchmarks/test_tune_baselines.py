"""A smoke run of the search benchmark (benchmarks/tune_baselines.py) on the trap model."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest


def _script():
    return importlib.import_module("benchmarks.tune_baselines")


@pytest.mark.slow
def test_trap_every_method_is_scored_and_tune_meets_the_optimum(tmp_path: Path) -> None:
    rc = _script().main(["--models", "trap", "--budgets", "0.01", "--no-seed-check",
                         "--out-dir", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "tune_baselines.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"tune", "uniform", "greedy-probe", "greedy-inc", "bisect", "random",
                         "optimum"}
    tune, opt = rows["tune"], rows["optimum"]
    assert tune["feasible"] == "True" and opt["feasible"] == "True"
    assert float(tune["within_budget"]) >= 0.98 * float(opt["within_budget"])
    # every method is charged from an empty cache: the shared scores are not free
    assert all(float(r["evaluations"]) > 0 for r in rows.values())
    assert "tune vs baselines" in (tmp_path / "tune_baselines.md").read_text()
