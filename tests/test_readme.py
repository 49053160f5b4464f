"""The README's snippets run as written: its Python blocks (in a scratch directory beside a
link to examples/), its policy file (it validates), and its CI command (the one
``.ci/run`` runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autoprec.policy import load_policy
from tests.helpers import ROOT, cli_env

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
    assert "autoprec tune examples/mixed8/model.py" in tune_cmd


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
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = cli_env()
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

    def options(cmd) -> set[str]:
        return {o for p in cmd.params if p.param_type_name == "option" and p.opts[0] != "--help"
                for o in ([*p.opts, *p.secondary_opts] if spellings else p.opts[:1])}

    # "": the options of `autoprec` itself (--version)
    return {"": options(group), **{name: options(cmd) for name, cmd in group.commands.items()}}


def _synopsis() -> dict[str, set[str]]:
    (block,) = [b for b in _blocks("", "Command line") if b.startswith("autoprec ")]
    out: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        text = line.split("#", 1)[0]
        if line.startswith("autoprec "):
            word = line.split()[1]
            command = "" if word.startswith("--") else word  # "": autoprec's own options
            out.setdefault(command, set())
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


def test_the_model_py_contract_names_what_loading_reads() -> None:
    """The model.py block lists every name autoprec reads from model.py, MODEL_NAME too
    (the README used policies/<MODEL_NAME>-<target>.yaml without saying what it was), and
    the rule MODEL_NAME must follow is loading's."""
    import inspect

    from autoprec.workload import loading

    (block,) = _blocks("python", "model.py")
    names = set(re.findall(r"^def (\w+)\(", block, flags=re.M))
    names |= set(re.findall(r"^([A-Z_]+) = ", block, flags=re.M))
    read = set(re.findall(r'fn\("(\w+)"', inspect.getsource(loading.load_model_file)))
    read |= set(re.findall(r'getattr\(module, "(\w+)"', inspect.getsource(loading)))
    assert read == names, (sorted(read - names), sorted(names - read))
    section = " ".join(README[README.index("\n## model.py\n"):
                              README.index("\n## Command line\n")].split())
    assert "policies/<MODEL_NAME>-<target>.yaml" in section
    assert "must be a plain name" in section and "at most 100 characters" in section
    assert loading.PLAIN_NAME.fullmatch("a" * 100) and not loading.PLAIN_NAME.fullmatch("a" * 101)
    assert not loading.PLAIN_NAME.fullmatch(".hidden") and not loading.PLAIN_NAME.fullmatch("a/b")


def test_the_ci_example_runs_the_check_the_readme_names() -> None:
    """examples/github-actions/autoprec-check.yml parses as a workflow, installs autoprec
    and runs the `autoprec check` line the README's CI section shows (a failing check,
    exit 1, fails the step: GitHub runs `run:` under `bash -e`)."""
    workflow = yaml.safe_load((ROOT / "examples" / "github-actions"
                               / "autoprec-check.yml").read_text())
    assert isinstance(workflow, dict) and workflow["jobs"]
    assert workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on:` as True
    steps = [st for job in workflow["jobs"].values() for st in job["steps"]]
    runs = [line.strip() for st in steps for line in str(st.get("run", "")).splitlines()]
    checks = [r for r in runs if r.startswith("autoprec check ")]
    assert len(checks) == 1, runs
    assert any("pip install" in r for r in runs[:runs.index(checks[0])])
    (shown,) = [b.strip() for b in _blocks("bash", "In CI: a pre-deployment gate")]
    assert shown == checks[0]
    args = shown.split()
    model, policy = args[2], args[args.index("--policy") + 1]
    assert (ROOT / model).is_file() and (ROOT / policy).is_file()
    assert "examples/github-actions/autoprec-check.yml" in README


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_results_links_reach_the_moved_sections() -> None:
    """The results moved to benchmarks/results/README.md: every link into it names one of
    its sections, the plot it shows is there, and it says which CPU made each table."""
    results = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", results, flags=re.M)}
    links = re.findall(r"\]\(benchmarks/results/README\.md#([\w-]+)\)", README)
    links += re.findall(r"\]\(#([\w-]+)\)", results)
    assert links
    assert not [a for a in links if a not in anchors], sorted(anchors)
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", results):
        assert (ROOT / "benchmarks" / "results" / image).is_file(), image
    for cpu in ("AMD EPYC", "Intel Xeon with AMX-BF16", "Intel Xeon without AMX"):
        assert cpu in " ".join(results.split()) and cpu in " ".join(README.split()), cpu
    assert (ROOT / "docs" / "robustness.md").is_file() and "docs/robustness.md" in README


def test_the_readme_says_where_the_caches_and_the_report_go() -> None:
    """The paths the first command writes, as the code names them (the README said the
    calibration cache was `.autoprec/calibration/`; it is beside the policy)."""
    from autoprec.pricing.speed_source import calibration_dir

    out = Path("quickstart/mixed8-h100.yaml")
    assert calibration_dir(out).as_posix() == "quickstart/.autoprec/calibration"
    for path in ("quickstart/studies/mixed8.db", "quickstart/.autoprec/probe-cache/",
                 "quickstart/.autoprec/calibration/",
                 "quickstart/.autoprec/mixed8-h100-max_error0.03-<hash>/"):
        assert f"`{path}`" in README, path


def test_every_benchmark_the_results_table_names_is_in_the_suite() -> None:
    from benchmarks.registry import BENCHMARKS

    start = README.index("\n## Results\n")
    table = README[start:README.index("\n## ", start + 1)]
    named = re.findall(r"^\|[^|]*\|[^|]*\| `(\w+)[^`]*` \|", table, flags=re.M)
    assert named and set(named) <= set(BENCHMARKS), set(named) - set(BENCHMARKS)


def test_every_relative_link_in_the_readme_and_docs_reaches_a_file() -> None:
    """A link to a moved or deleted file (docs/overview.md named a benchmarks-history.md
    that never existed) is a dead end for a reader."""
    dead = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):
                continue  # an anchor on the page, a URL
            if not (page.parent / path).exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dead, dead
