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


def test_gpu_latency_analytic_graph_matches_the_tracer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_latency", ROOT / "experiments" /
                                                  "gpu_latency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from autoprec.trace import trace

    d, T, L = 64, 16, 2
    with torch.no_grad():
        traced = trace(mod.GPTStack(d, 2, L).eval(), torch.randn(1, T, d))
    hand = mod.analytic_graph(d, T, L)
    assert [n.path for n in traced.gemm_nodes] == [n.path for n in hand.gemm_nodes]
    for n in hand.gemm_nodes:
        t = traced[n.path]
        assert (t.flops, t.weight_elems, t.in_elems, t.out_elems) == \
            (n.flops, n.weight_elems, n.in_elems, n.out_elems), n.path


@pytest.mark.slow
def test_apply_overhead_smoke_labels_the_issue_row(tmp_path):
    r = _run("experiments/apply_overhead.py", "--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "ISSUE 13: default: fp16 (no rules) / global autocast fp16" in r.stdout
    assert "thread CPU time" in r.stdout and "issue 13 target: ratio <= 1.03" in r.stdout
    import pandas as pd

    df = pd.read_csv(tmp_path / "apply_overhead.csv")
    assert (df["ratio"] > 0).all() and df["comparison"].str.startswith("ISSUE 13").sum() == 1
    # the cost model counts the same plans: the uniform policy runs the casts one global
    # autocast runs, the per-leaf islands two more per layer
    issue = df[df["comparison"].str.startswith("ISSUE 13")].iloc[0]
    assert issue["policy_casts"] == issue["baseline_casts"]
    assert "apply_overhead.py --smoke" in (tmp_path / "apply_overhead.md").read_text()
