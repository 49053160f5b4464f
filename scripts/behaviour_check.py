"""Record what ``autoprec`` writes and prints for a fixed set of tunes, and compare later.

Each case runs ``autoprec tune`` (``--json --no-track --seed 0 --quiet``) into a fixed scratch
folder, then ``autoprec eval --json`` and ``autoprec check --json`` of the written policy,
and keeps, per command, the exit code, the JSON printed, the stderr lines and (for tune)
the policy YAML. Run-to-run noise is normalised away: timestamps, seconds and memory
figures (by key, and inside text), and the scratch folder's path.

    python scripts/behaviour_check.py record OUT.json     # the baseline, before a change
    python scripts/behaviour_check.py compare OUT.json    # after: "identical" or the diff

``compare`` exits 0 when every case is identical, 1 otherwise. ``--only NAME`` runs the
named cases only (repeatable); ``--scratch DIR`` works in DIR instead of
/tmp/autoprec-behaviour (two checkouts checking at once on one machine).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "examples"
SCRATCH = Path("/tmp/autoprec-behaviour")

#: name -> (model.py, tune options, eval/check options). The README's and benchmarks'
#: commands: the quickstart's mixed8, trap as tune's default and at the README API's batch,
#: MiniLM for this CPU without timing, mixed8 priced compiled, and GPT-2 tuned for training.
#: (A CPU-measured plan is left out: its measured figures, and so the plan written, vary
#: from run to run.)
CASES: dict[str, tuple[Path, list[str], list[str]]] = {
    "trap-h100": (EXP / "trap/model.py", ["--target", "h100"], ["--target", "h100"]),
    "trap-h100-b65536": (EXP / "trap/model.py",
                         ["--target", "h100", "--batch-size", "65536"],
                         ["--target", "h100", "--batch-size", "65536"]),
    "mixed8-h100": (EXP / "mixed8/model.py",
                    ["--target", "h100", "--max-error", "0.03", "--batch-size", "65536"],
                    ["--target", "h100", "--batch-size", "65536"]),
    "mixed8-h100-compile": (EXP / "mixed8/model.py",
                            ["--target", "h100", "--max-error", "0.03", "--batch-size",
                             "65536", "--compile"],
                            ["--target", "h100", "--batch-size", "65536", "--compile"]),
    "minilm-cpu": (EXP / "minilm/model.py",
                   ["--target", "cpu", "--no-measure", "--max-drop", "0.02"],
                   ["--target", "cpu"]),
    # a training plan: the step priced with model.py's loss (issue 54's GPT-2 case)
    "gpt-h100-train": (EXP / "gpt/model.py",
                       ["--target", "h100", "--form", "train", "--max-error", "0.03",
                        "--batch-size", "64", "--trials", "12"],
                       ["--target", "h100", "--batch-size", "64"]),
}

#: Keys whose values are wall-clock time, dates or memory: replaced by a placeholder.
NOISY_KEY = re.compile(
    r"(^|_)(seconds|secs|elapsed|created|time|timestamp|date|memory|peak|rss|wall)(_|$)"
    r"|_s$|_gb$|_mb$|_bytes_peak$", re.I)
#: Figures inside text: "3.1 s", "in 4.8 min", "5.34 GB", "2026-12-04T21:34:04+00:00".
NOISY_TEXT = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?"), "<time>"),
    (re.compile(r"\b\d+(\.\d+)? ?(s|ms|min|h)\b"), "<secs>"),
    (re.compile(r"\b\d+(\.\d+)? ?(GB|MB|GiB|MiB|KB|KiB)\b"), "<mem>"),
]


#: A checkout's path (the baseline may come from another one).
REPO_PATH = re.compile(r"/[\w./-]*?/(?=examples/)")


def _norm_text(text: str) -> str:
    text = text.replace(str(SCRATCH), "<scratch>")
    text = REPO_PATH.sub("<repo>/", text)
    for pattern, repl in NOISY_TEXT:
        text = pattern.sub(repl, text)
    return text


def normalise(value: Any, key: str = "") -> Any:
    """``value`` with noisy figures replaced (recursively for dicts and lists)."""
    if key and NOISY_KEY.search(key):
        return "<noisy>"
    if isinstance(value, dict):
        return {k: normalise(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        return _norm_text(value)
    return value


#: A library's log line: torch's glog-style warnings ("W1205 01:19:34.900000 17916 …",
#: stamped with the time and the process id) and torchao's optional kernels it could not load.
LIBRARY_LOG = re.compile(r"^[WIEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ |^Failed to load .*\.so")


def _kept(line: str) -> bool:
    """A stderr line worth comparing: not a progress bar, not a library's warning."""
    return not (line.startswith(("Warning:", "  warnings.warn")) or "it/s]" in line
                or "%|" in line or not line.strip() or LIBRARY_LOG.search(line))


def clean(case: dict[str, Any]) -> dict[str, Any]:
    """A recorded case normalised again (a baseline recorded by an earlier version of these
    rules compares on today's)."""
    out = normalise(case)
    for v in out.values():
        if isinstance(v, dict) and "stderr" in v:
            v["stderr"] = [line for line in v["stderr"] if _kept(line)]
    return out


def _run(args: list[str], cwd: Path) -> dict[str, Any]:
    exe = str(Path(sys.executable).parent / "autoprec")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    try:
        out: Any = json.loads(proc.stdout) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        out = proc.stdout
    return {"rc": proc.returncode, "json": normalise(out),
            "stderr": [_norm_text(line) for line in proc.stderr.splitlines() if _kept(line)]}


def run_case(name: str) -> dict[str, Any]:
    """One case's tune, eval and check, normalised."""
    model, tune_opts, eval_opts = CASES[name]
    work = SCRATCH / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    policy = work / f"{name}.yaml"
    out: dict[str, Any] = {}
    out["tune"] = _run(["tune", str(model), *tune_opts, "--seed", "0", "--no-track",
                        "--quiet", "--json", "--out", str(policy)], work)
    out["policy"] = normalise(yaml.safe_load(policy.read_text())) if policy.exists() else None
    if policy.exists():
        out["eval"] = _run(["eval", str(model), "--policy", str(policy), *eval_opts,
                            "--json"], work)
        budget = [o for o in tune_opts if o in ("--max-error", "--max-drop")]
        budget_opts = tune_opts[tune_opts.index(budget[0]):][:2] if budget else []
        check_opts = [o for o in eval_opts] + budget_opts
        out["check"] = _run(["check", str(model), "--policy", str(policy), *check_opts,
                             "--json"], work)
        # A budget the policy cannot meet: check's failing exit code and its JSON.
        tight = [o for o in eval_opts] + (
            ["--max-drop", "-1"] if "--max-drop" in tune_opts else ["--max-error", "1e-9"])
        out["check_tight"] = _run(["check", str(model), "--policy", str(policy), *tight,
                                   "--json"], work)
    return out


def _dump(obj: Any) -> list[str]:
    return json.dumps(obj, indent=1, sort_keys=True, default=str).splitlines()


def main() -> int:
    global SCRATCH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["record", "compare"])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("--only", action="append", choices=sorted(CASES))
    ap.add_argument("--scratch", type=Path, default=SCRATCH,
                    help="the scratch folder (default /tmp/autoprec-behaviour)")
    args = ap.parse_args()
    SCRATCH = args.scratch.resolve()
    names = args.only or list(CASES)
    results = {}
    for name in names:
        print(f"running {name} …", file=sys.stderr, flush=True)
        results[name] = run_case(name)
    if args.mode == "record":
        old = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
        old.update(results)
        args.baseline.write_text(json.dumps(old, indent=1, sort_keys=True, default=str) + "\n")
        print(f"recorded {', '.join(names)} in {args.baseline}")
        return 0
    base = json.loads(args.baseline.read_text())
    same = True
    print(f"{'case':<22} result")
    for name in names:
        a, b = _dump(clean(base.get(name) or {})), _dump(clean(results[name]))
        diff = list(difflib.unified_diff(a, b, "baseline", "now", lineterm="", n=2))
        print(f"{name:<22} {'identical' if not diff else f'DIFFERENT ({len(diff)} diff lines)'}")
        if diff:
            same = False
            print("\n".join(diff[:200]))
    print("all identical" if same else "DIFFERENCES FOUND")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
