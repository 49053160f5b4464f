"""`autoprec --version` prints the package's version and exits 0."""

from __future__ import annotations

import re
import subprocess

import autoprec
from tests.helpers import CLI, ROOT, run_cli


def test_version_prints_the_package_version_and_exits_0(capsys) -> None:
    code, out, err = run_cli(["--version"], capsys)
    assert code == 0, err
    assert out == f"autoprec {autoprec.__version__}\n"
    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared and declared.group(1) == autoprec.__version__


def test_version_runs_as_a_command_without_a_subcommand() -> None:
    run = subprocess.run([*CLI, "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"autoprec {autoprec.__version__}"
