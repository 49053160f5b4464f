"""A smoke run of benchmarks/tune_time_train.py: a training tune of a small example in its
own process, every stage's wall and CPU seconds in the table."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest


def _script():
    return importlib.import_module("benchmarks.tune_time_train")


def test_the_table_shows_each_stage_and_the_earlier_run_beside_it() -> None:
    mod = _script()
    row = {"command": "autoprec tune x", "wall_s": 10.0, "cpu_s": 8.0,
           "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 1.0, 1.0],
           "stage_wall_s": {"reference": 1.0, "probe": 5.0, "confirm": 3.0},
           "stage_cpu_s": {"reference": 0.9, "probe": 4.0, "confirm": 2.5},
           "train_check_s": 2.0, "train_checks": [{"plan": "fp32", "seconds": 1.0}],
           "written": "default fp32, 0 layer rules", "est_speedup": 1.0}
    text = "\n".join(mod.table("cpu", row, {"stage_wall_s": {"probe": 50.0},
                                            "stage_cpu_s": {}, "wall_s": 60.0}))
    assert "| probe | 5.0 | 4.0 | 50.0 | - |" in text
    assert "| **whole tune (process)** | 10.0 | 8.0 | 60.0 | - |" in text
    assert "short training runs 2.0 s wall: fp32 1.0 s" in text
    assert mod.cpu_model()


def test_an_unknown_case_is_one_line_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _script().main(["--cases", "tpu"])
    assert exc.value.code == 2
    assert "unknown case 'tpu'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_training_tune_reports_every_stage_in_wall_and_cpu_seconds(tmp_path: Path) -> None:
    mod = _script()
    out, js = tmp_path / "t.md", tmp_path / "t.json"
    assert mod.main(["--cases", "h100-train", "--model", "grad_hazard", "--extra",
                     "--trials 2 --train-steps 2 --max-error 0.05", "--out", str(out),
                     "--json-out", str(js)]) == 0
    row = json.loads(js.read_text())["cases"]["h100-train"]
    assert set(row["stage_wall_s"]) == set(row["stage_cpu_s"]) >= {"probe", "search", "confirm"}
    assert all(v >= 0 for v in row["stage_cpu_s"].values()) and row["cpu_s"] > 0
    assert row["train_checks"] and row["train_checks"][0]["plan"] == "fp32"
    assert "| probe |" in out.read_text()
