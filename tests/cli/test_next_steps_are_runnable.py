"""The `next:` lines tune prints run as printed: after the README's set-up the venv is not
activated, so `autoprec check …` and `mlflow ui …` were "command not found"."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from autoprec.cli.runnable import autoprec_command, tool_command
from tests.helpers import ROOT, TRAP, cli_env


def _script(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_venv_script_not_on_path_is_shown_by_its_path(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / ".venv" / "bin"
    monkeypatch.setattr(sys, "argv", [str(_script(bin_dir / "autoprec")), "tune"])
    _script(bin_dir / "mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert autoprec_command() == ".venv/bin/autoprec"
    assert tool_command("mlflow") == ".venv/bin/mlflow"
    monkeypatch.chdir(ROOT)  # outside the folder: the absolute path
    assert autoprec_command() == str(bin_dir / "autoprec")


def test_an_activated_venv_script_is_shown_by_its_name(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / ".venv" / "bin"
    monkeypatch.setattr(sys, "argv", [str(_script(bin_dir / "autoprec")), "tune"])
    _script(bin_dir / "mlflow")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert autoprec_command() == "autoprec"
    assert tool_command("mlflow") == "mlflow"


def test_python_dash_m_is_shown_as_python_dash_m(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(ROOT / "autoprec" / "cli" / "main.py"), "tune"])
    cmd = autoprec_command()
    assert cmd.endswith(" -m autoprec.cli.main"), cmd
    assert os.path.abspath(shlex.split(cmd)[0]) == os.path.abspath(sys.executable) or \
        shlex.split(cmd)[0] == Path(sys.executable).name


@pytest.mark.slow
def test_the_printed_check_command_runs(tmp_path: Path) -> None:
    """End to end, the way the README runs it: tune through the venv's own `autoprec`
    script (not on PATH), then the `next:` check line exactly as printed."""
    script = Path(sys.executable).parent / "autoprec"
    if not script.is_file():
        pytest.skip(f"no autoprec console script beside {sys.executable}")
    env = cli_env(PATH=os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                       if Path(p).resolve() != script.parent.resolve()))
    tune = subprocess.run([str(script), "tune", str(TRAP), "--no-track", "--quiet",
                           "--trials", "1", "--out", "p.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert tune.returncode == 0, tune.stderr[-3000:]
    line = next(ln for ln in tune.stdout.splitlines() if ln.startswith("next: "))
    argv = shlex.split(line.removeprefix("next: ").split("#", 1)[0])
    assert argv[0] == str(script) and argv[1] == "check", argv
    check = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert check.returncode == 0 and "PASSED" in check.stdout, check.stdout + check.stderr
