"""The README's snippets run as written: its Python blocks (in a scratch directory beside a
link to experiments/), its policy file (it validates), and its CI command (the one
``.ci/run`` runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoprec.policy import load_policy

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str, section: str | None = None) -> list[str]:
    text = README
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end != -1 else None]
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_ci_command_is_the_readmes() -> None:
    (setup,) = _blocks("bash")[:1]
    lines = [line for line in setup.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 2, lines
    tune_cmd, test_cmd = lines
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, f".ci/run does not run the README's test command: {test_cmd}"
    for cmd in (tune_cmd, test_cmd):  # the CPU torch, never a CUDA build pulled by a range
        assert "-c constraints/cpu.txt" in cmd
    assert (ROOT / "constraints" / "cpu.txt").is_file()
    assert "autoprec tune experiments/mixed8/model.py" in tune_cmd


def test_the_policy_file_example_validates(tmp_path: Path) -> None:
    (yaml_text,) = _blocks("yaml", "The policy file")
    path = tmp_path / "p.yaml"
    path.write_text(yaml_text)
    policy = load_policy(path)
    assert policy.layers and policy.metrics["feasible"] is True


@pytest.mark.slow
def test_the_python_snippets_run_as_written(tmp_path: Path) -> None:
    blocks = _blocks("python", "Python API")
    assert len(blocks) == 2, "the API example and the training example"
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outputs = []
    for i, code in enumerate(blocks):  # one process each, in order: as a user pastes them
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"README Python block {i + 1}:\n{run.stderr[-3000:]}"
        outputs.append(run.stdout)
    assert (tmp_path / "policies" / "trap-api.yaml").is_file()
    assert "trap-api.yaml" in outputs[0] and outputs[1].startswith("loss ")
