"""The prepared GPU script for the committed policies: its CPU dry run and its refusal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _script():
    return importlib.import_module("benchmarks.gpu_policies")


@pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
def test_dry_run_measures_a_committed_policy(tmp_path: Path) -> None:
    rc = _script().main(["--dry-run", "--only", "mixed8-h100", "--out", str(tmp_path)])
    assert rc == 0
    text = (tmp_path / "gpu_policies.md").read_text()
    assert "mixed8-h100.yaml" in text and "error" not in text
    import pandas as pd

    row = pd.read_csv(tmp_path / "gpu_policies.csv").iloc[0]
    assert row["audit"] == "ok" and row["target"] == "h100"
    for col in ("tuned_speedup", "tuned_over_bf16", "tuned_over_fp16", "est_tuned_speedup",
                "est_bf16_speedup", "casts"):
        assert row[col] > 0, col


def test_enlarge_repeats_rows_to_the_deployment_batch() -> None:
    mod = _script()
    batch = {"ids": torch.arange(6).reshape(2, 3), "n": 1}
    big = mod.enlarge(batch, 5)
    assert big["ids"].shape == (5, 3) and big["n"] == 1
    assert torch.equal(big["ids"][2], batch["ids"][0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_it_says_why_and_exits_1(capsys) -> None:
    assert _script().main([]) == 1
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="cuda: torch.cuda.is_available() is False")
@pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
def test_a_committed_policy_runs_on_a_gpu(tmp_path: Path) -> None:
    assert _script().main(["--only", "mixed8-h100", "--max-batch", "1024",
                           "--out", str(tmp_path)]) == 0
    import pandas as pd

    row = pd.read_csv(tmp_path / "gpu_policies.csv").iloc[0]
    assert row["audit"] == "ok" and row["tuned_ms"] > 0
