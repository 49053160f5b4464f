"""The cost benchmarks' scripts run end to end at toy sizes (CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_gpu_latency_dry_run_writes_results(tmp_path):
    r = _run("-m", "benchmarks.gpu_latency", "--dry-run", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in ("results.csv", "results.md", "micro.csv", "h200.calibration.yaml"):
        assert (tmp_path / name).is_file()
    import pandas as pd

    df = pd.read_csv(tmp_path / "results.csv")
    assert list(df["run"]) == ["all-fp32", "all-tf32 (global flag)", "global autocast bf16",
                               "global autocast fp16", "default: bf16", "default: fp16",
                               "fp8 mix (bf16 + fp8 qkv/fc1/fc2)",
                               "per-leaf islands (fp32 + bf16 per leaf)"]
    assert (df["measured_ms"] > 0).all() and (df["est_cal_ms"] > 0).all()
    # a region policy is priced exactly as the global autocast it equals
    by = df.set_index("run")
    assert by.loc["default: bf16", "vs_autocast_est"] == pytest.approx(1.0)
    assert by.loc["per-leaf islands (fp32 + bf16 per leaf)", "casts"] > \
        by.loc["default: bf16", "casts"]
    assert (df["audit"].dropna() == "ok").all()
    text = (tmp_path / "results.md").read_text()
    assert "DRY RUN" in text and "prediction error" in text
    micro = pd.read_csv(tmp_path / "micro.csv")
    assert {"fp32", "tf32", "bf16", "fp16", "fp8"} <= {s.split()[-1] for s in micro["sample"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_latency_without_cuda_says_why(tmp_path):
    r = _run("-m", "benchmarks.gpu_latency", "--out", str(tmp_path))
    assert r.returncode == 1
    assert "no CUDA device" in r.stderr and "--dry-run" in r.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_cost_model_cpu_smoke(tmp_path):
    r = _run("-m", "benchmarks.cost_model_cpu", "--smoke", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Spearman(estimate, measured)" in r.stdout
    assert (tmp_path / "cost_model_cpu.csv").is_file()


def _script(name: str):
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


@pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
def test_gpu_latency_runs_are_priced_as_they_run():
    """Each applied run of the GPU script, counted op by op on a real forward (here, for
    the h200 target), runs the casts its estimate prices; fp8 goes to qkv/fc1/fc2 only."""
    from autoprec.cost import CostModel, get_profile
    from autoprec.trace import trace
    from tests.plan.test_what_runs_is_priced import run_counted

    mod = _script("gpu_latency")
    net = mod.GPTStack(64, 2, 2).eval()
    x = torch.randn(2, 16, 64)
    cost = CostModel(trace(net, x, tracers=("hooks",)), get_profile("h200"))
    applied = [r for r in mod.runs(net, 64, "cpu", fp8_ok=True) if r.applied is not None]
    assert len(applied) == 4
    for r in applied:
        bd = cost.breakdown(r.priced)
        got = run_counted(net, r.applied, lambda m, b: m(b), x, target="h200")
        assert got.casts == bd.casts + bd.weight_casts, r.name
    fp8 = next(r for r in applied if r.name.startswith("fp8"))
    assert sorted(fp8.applied.layers) == sorted(
        f"blocks.{b}.{p}" for b in range(2) for p in ("attn.qkv", "mlp.fc1", "mlp.fc2"))
    assert set(fp8.applied.layers.values()) == {"fp8"} and fp8.applied.default == "bf16"


@pytest.mark.slow
def test_apply_overhead_smoke_labels_the_issue_row(tmp_path):
    r = _run("-m", "benchmarks.apply_overhead", "--smoke", "--out", str(tmp_path))
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
    assert "benchmarks.apply_overhead --smoke" in (tmp_path / "apply_overhead.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="cuda: torch.cuda.is_available() is False")
def test_gpu_latency_runs_on_a_gpu_at_small_sizes(tmp_path):
    r = _run("-m", "benchmarks.gpu_latency", "--d-model", "512", "--heads", "8", "--seq", "256",
             "--batch", "2", "--layers", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    import pandas as pd

    df = pd.read_csv(tmp_path / "results.csv")
    assert (df["measured_ms"] > 0).all()
    assert (df["audit"].dropna() == "ok").all()


@pytest.mark.slow
def test_gpu_latency_dry_run_measures_compiled_runs(tmp_path):
    r = _run("-m", "benchmarks.gpu_latency", "--dry-run", "--compile", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    import pandas as pd

    df = pd.read_csv(tmp_path / "compiled.csv")
    assert list(df["run"]) == ["all-fp32", "global autocast bf16", "default: bf16",
                               "fp8 mix (bf16 + fp8 qkv/fc1/fc2)",
                               "per-leaf islands (fp32 + bf16 per leaf)"]
    assert "error" not in df.columns or df["error"].isna().all(), df.get("error")
    assert (df["measured_ms"] > 0).all() and (df["est_cal_ms"] > 0).all()
    assert "torch.compile" in (tmp_path / "results.md").read_text()
