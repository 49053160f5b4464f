"""A smoke run of the depth benchmark (benchmarks/tune_depth.py) at one block."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _script():
    return importlib.import_module("benchmarks.tune_depth")


def test_the_growth_exponent_is_the_log_log_slope() -> None:
    mod = _script()
    assert mod.fit_exponent([10, 20, 40], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert mod.fit_exponent([10, 20, 40], [1.0, 4.0, 16.0]) == pytest.approx(2.0)


@pytest.mark.slow
def test_one_block_is_tuned_and_every_stage_reported(tmp_path: Path) -> None:
    row = _script().run_one("gpt2", 1, tmp_path)
    assert row["layers"] == 5 and row["feasible"]
    assert row["forwards"] == (row["fwd_other"] + row["fwd_trace"] + row["fwd_probe"]
                               + row["fwd_eval"]) > 0
    assert row["priced"] > 0 and row["total"] >= row["planner"] > 0
    # never slower (on the cost model) than the best one-line alternative
    assert row["speedup"] >= max(row["alt_tf32"], row["alt_bf16"], row["alt_fp16"]) * 0.999
