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


def _cli_options(spellings: bool = False) -> dict[str, set[str]]:
    """Every command of the CLI and its options (the first spelling of each; with
    ``spellings`` every spelling, ``--no-resume`` too)."""
    import typer

    from autoprec.cli.main import _register, app

    _register()
    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params
                   if p.param_type_name == "option" and p.opts[0] != "--help"
                   for o in ([*p.opts, *p.secondary_opts] if spellings else p.opts[:1])}
            for name, cmd in group.commands.items()}


def _synopsis() -> dict[str, set[str]]:
    (block,) = [b for b in _blocks("", "Command line") if b.startswith("autoprec ")]
    out: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        text = line.split("#", 1)[0]
        if line.startswith("autoprec "):
            command = line.split()[1]
            out[command] = set()
        assert command is not None, line
        out[command] |= set(re.findall(r"--[a-z][a-z0-9-]*", text))
    return out


def test_the_synopsis_is_the_clis_options() -> None:
    """The README's synopsis lists every command and every option, and nothing
    else (it had drifted: tune's --min-speedup, --lock, --json missing, probe's --layer …)."""
    readme, cli, spelled = _synopsis(), _cli_options(), _cli_options(spellings=True)
    assert sorted(readme) == sorted(cli)
    for name in cli:
        assert cli[name] <= readme[name] <= spelled[name], (
            name, "missing in README:", sorted(cli[name] - readme[name]),
            "not in the CLI:", sorted(readme[name] - spelled[name]))


def test_target_help_lists_every_profile() -> None:
    from autoprec.cli import target_names
    from autoprec.cost import known_devices

    assert target_names() == ", ".join(known_devices())
    assert f"({target_names()}; `autoprec tune --help`" in " ".join(README.split())


@pytest.mark.slow
def test_the_first_command_leaves_the_checkout_clean(tmp_path: Path) -> None:
    """The README's first command in a fresh clone writes only ignored files (it
    used to rewrite the tracked policies/mixed8-h100.yaml); what it writes is what the
    README says."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (setup,) = _blocks("bash")[:1]
    tune_line = next(line for line in setup.splitlines() if "autoprec tune" in line)
    tune_cmd = tune_line[tune_line.index(".venv/bin/autoprec tune"):]
    args = tune_cmd.split()[2:]  # after ".venv/bin/autoprec tune"
    env = {**os.environ, "PYTHONPATH": str(clone)}
    run = subprocess.run([sys.executable, "-m", "autoprec.cli.main", "tune", *args,
                          "--quiet"], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True,
                            text=True, check=True).stdout
    assert status == "", status
    out = args[args.index("--out") + 1]
    assert (clone / out).is_file() and f"`{out}`" in README
    assert (clone / "quickstart" / "studies" / "mixed8.db").is_file()
    load_policy(clone / out)
