"""The cost experiments' scripts run end to end at toy sizes (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_gpu_latency_dry_run_writes_results(tmp_path):
    r = _run("experiments/gpu_latency.py", "--dry-run", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in ("results.csv", "results.md", "micro.csv", "h200.calibration.yaml"):
        assert (tmp_path / name).is_file()
    import pandas as pd

    df = pd.read_csv(tmp_path / "results.csv")
    assert list(df["run"]) == ["all-fp32", "all-tf32", "all-bf16", "all-fp16", "all-fp8",
                               "mixed"]
    assert (df["measured_ms"] > 0).all() and (df["est_calibrated_ms"] > 0).all()
    assert "DRY RUN" in (tmp_path / "results.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_latency_without_cuda_says_why(tmp_path):
    r = _run("experiments/gpu_latency.py", "--out", str(tmp_path))
    assert r.returncode == 1
    assert "no CUDA device" in r.stderr and "--dry-run" in r.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_cost_model_cpu_smoke(tmp_path):
    r = _run("experiments/cost_model_cpu.py", "--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Spearman(estimate, measured)" in r.stdout
    assert (tmp_path / "cost_model_cpu.csv").is_file()
