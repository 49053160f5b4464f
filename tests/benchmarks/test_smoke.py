"""Every benchmark runs end to end at a toy size, as a user runs it (``python -m
benchmarks.NAME``), prints its table, and writes nothing into the checkout; every script in
benchmarks/ is in the suite's registry (``benchmarks/registry.py``), with its toy size or
the reason it has none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.registry import BENCHMARKS, GROUPS, SUPPORT
from tests.helpers import ROOT, cli_env

SMOKE = {name: b for name, b in BENCHMARKS.items() if b.toy is not None}


def _status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.timeout(b.timeout_s)) for n, b in sorted(SMOKE.items())])
def test_the_benchmark_runs_at_toy_size(name: str, tmp_path: Path) -> None:
    bench = SMOKE[name]
    if bench.needs:
        pytest.importorskip(bench.needs, reason=f"{name} needs {bench.needs}")
    before = _status()
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}",
         *(a.replace("{tmp}", str(tmp_path)) for a in bench.toy or [])],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=bench.timeout_s)
    assert run.returncode in ((0, 1) if bench.verdict_exit else (0,)), run.stderr[-3000:]
    assert bench.prints in run.stdout
    assert _status() == before, f"{name} wrote into the checkout"


def test_every_script_is_in_the_suite() -> None:
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - SUPPORT
    assert scripts - set(BENCHMARKS) == set(), "add these to benchmarks/registry.py"
    assert set(BENCHMARKS) - scripts == set(), "registered, but no such script"
    for name, b in BENCHMARKS.items():
        assert b.group in GROUPS, name
        assert (b.toy is None) == bool(b.untested_because), name


def test_the_suite_lists_and_refuses_an_unknown_name() -> None:
    listed = subprocess.run([sys.executable, "-m", "benchmarks", "list"], cwd=ROOT,
                            env=cli_env(), capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert all(f"  {name} " in listed.stdout for name in BENCHMARKS)
    run = subprocess.run([sys.executable, "-m", "benchmarks", "run", "nope"], cwd=ROOT,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("benchmarks: unknown benchmark 'nope'; known: ")


def test_an_unknown_example_is_refused_in_one_line() -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.blockscale_error", "--models",
                          "nope"], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "blockscale_error: unknown model 'nope'; known: ")


def test_the_shared_loader_lists_the_examples() -> None:
    from benchmarks.common import example, example_names

    assert {"trap", "mixed8", "minilm", "wide"} <= set(example_names())
    assert example("trap") == ROOT / "examples" / "trap" / "model.py"
