"""What a training tune costs, stage by stage: wall and CPU seconds, on the machine at hand.

The cases are the issue-46 training tunes of the MiniLM masked-LM fine-tune
(``examples/minilm_mlm``: pretrained all-MiniLM-L6-v2, stdlib docstrings):

    cpu        autoprec tune examples/minilm_mlm/model.py --form train --target cpu
    cpu-train-aware
               autoprec tune examples/minilm_mlm/model.py --train-aware --target cpu
    h100-train autoprec tune examples/minilm_mlm/model.py --train-aware --target h100
               --batch-size 64

Each runs as its own process (``autoprec tune ... --json --no-track --quiet``, a fresh
study and probe cache in a temporary folder), and the script prints per stage the wall
and CPU seconds the tune reports (``stage_seconds`` / ``stage_cpu_seconds`` of its JSON;
the short training runs are part of ``confirm``), the process's own CPU (user + system,
``getrusage`` of the child), the CPU model (``lscpu``) and the load average before and
after. ``--before FILE`` puts an earlier run's JSON (this script's ``--json-out``) beside
each figure. Under a shared load the wall time grows with the other processes' turns; the
CPU seconds are what the tune itself spent.

    python -m benchmarks.tune_time_train                      # every case
    python -m benchmarks.tune_time_train --cases cpu --model minilm_mlm
    python -m benchmarks.tune_time_train --before benchmarks/results/tune_time_train.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, _refuse, choose, example

#: name -> the tune's options after the model.py (the issue's two training tunes).
CASES: dict[str, list[str]] = {
    "cpu": ["--form", "train", "--target", "cpu"],
    "cpu-train-aware": ["--train-aware", "--target", "cpu"],
    "h100-train": ["--train-aware", "--target", "h100", "--batch-size", "64"],
}
STAGES = ("reference", "trace", "probe", "search", "confirm")


def cpu_model() -> str:
    """``lscpu``'s model name (or the platform's processor when lscpu is absent)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        import platform

        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def autoprec_command() -> list[str]:
    """The ``autoprec`` console script beside this Python (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "autoprec"
    found = str(here) if here.is_file() else shutil.which("autoprec")
    if found is None:
        _refuse("no autoprec command beside this Python or on PATH")
    return [str(found)]


def run_case(model: Path, options: list[str], workdir: Path,
             extra: list[str] | None = None) -> dict[str, Any]:
    """One tune in its own process: its JSON's stage times, the process's CPU and wall
    seconds and the load average around it."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [*autoprec_command(), "tune", str(model), *options, *(extra or []), "--json",
           "--no-track", "--quiet", "--seed", "0", "--out", str(workdir / "policy.yaml")]
    load_before = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {tail[0]}")
    out = json.loads(proc.stdout)
    from autoprec.policy import load_policy

    pol = load_policy(workdir / "policy.yaml")
    return {
        "command": "autoprec tune " + " ".join([_rel(model), *options, *(extra or [])]),
        "wall_s": round(wall, 1),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                       1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "stage_wall_s": out.get("stage_seconds", {}),
        "stage_cpu_s": out.get("stage_cpu_seconds", {}),
        "train_check_s": out.get("train_check_seconds", 0.0),
        "train_checks": [{k: c.get(k) for k in ("plan", "seconds", "passed", "gap")}
                         for c in out.get("train_checks", [])],
        "written": f"default {pol.default}, {len(pol.layers)} layer rules",
        "est_speedup": out.get("est_speedup"),
    }


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1f}"


def table(name: str, row: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    """One case as a markdown table: stage, wall s, CPU s (and the earlier run's)."""
    b = before or {}
    head = "| stage | wall s | CPU s |" + (" before wall s | before CPU s |" if before else "")
    lines = [f"### {name}: `{row['command']}`", "", head,
             "|---|---:|---:|" + ("---:|---:|" if before else "")]
    stages = [s for s in STAGES if s in row["stage_wall_s"]] + [
        s for s in row["stage_wall_s"] if s not in STAGES]
    for s in stages:
        cells = [s, _fmt(row["stage_wall_s"].get(s)), _fmt(row["stage_cpu_s"].get(s))]
        if before:
            cells += [_fmt(b.get("stage_wall_s", {}).get(s)),
                      _fmt(b.get("stage_cpu_s", {}).get(s))]
        lines.append("| " + " | ".join(cells) + " |")
    total = ["**whole tune (process)**", _fmt(row["wall_s"]), _fmt(row["cpu_s"])]
    if before:
        total += [_fmt(b.get("wall_s")), _fmt(b.get("cpu_s"))]
    lines.append("| " + " | ".join(total) + " |")
    if row["train_checks"]:
        runs = ", ".join(f"{c['plan']} {_fmt(c['seconds'])} s" for c in row["train_checks"])
        lines += ["", f"short training runs {_fmt(row['train_check_s'])} s wall: {runs}"]
    lines += ["", f"load average (1/5/15 min) before {row['load_before']}, after "
                  f"{row['load_after']}; written: {row['written']} "
                  f"(est. {row['est_speedup']}x)", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: "
                    + ", ".join(CASES))
    ap.add_argument("--model", default="minilm_mlm", help="an example under examples/")
    ap.add_argument("--extra", default="", help="more tune options for every case, e.g. "
                    "'--trials 1' (a smoke run)")
    ap.add_argument("--before", type=Path, help="an earlier run's --json-out to compare with")
    ap.add_argument("--out", type=Path, default=RESULTS / "tune_time_train.md")
    ap.add_argument("--json-out", type=Path, default=RESULTS / "tune_time_train.json")
    args = ap.parse_args(argv)
    names = choose(args.cases, CASES, "case")
    model = example(args.model)
    before = json.loads(args.before.read_text()) if args.before else {}
    results: dict[str, Any] = {"cpu_model": cpu_model(), "cases": {}}
    lines = [f"# Training tunes of `{args.model}`: what each stage spent", "",
             "```", f"python -m benchmarks.tune_time_train {' '.join(argv or sys.argv[1:])}",
             "```", "", f"CPU: {results['cpu_model']}; torch threads: default; "
             f"{os.cpu_count()} logical CPUs. CPU s = user + system of the tune's process "
             "(every thread); wall s grows with the machine's other load, CPU s does not.", ""]
    with tempfile.TemporaryDirectory(prefix="tune_time_train-") as tmp:
        for name in names:
            row = run_case(model, CASES[name], Path(tmp) / name, args.extra.split())
            results["cases"][name] = row
            lines += table(name, row, before.get("cases", {}).get(name))
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
