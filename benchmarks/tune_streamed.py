"""Peak memory and time of ``autoprec tune DIR`` on checkpoints streamed block by block.

Each checkpoint folder (``benchmarks/make_llama_checkpoint.py`` writes random-weight Llamas
at TinyLlama-1.1B, Llama-3.2-3B and Llama-3.1-8B shapes) is tuned in its own process as
``autoprec tune DIR`` tunes it: ``autoprec.tune(DIR, target=..., progress=True)`` (the
blocks stream from the shards; calibration is one batch of 1 x 64 tokens of real text) in
a child process (``--child``), whose summary (error, speed-up, the policy's rules, each
stage's peak and wall time) comes back as JSON. Measured from outside the child:

- **peak RSS**: the child's ``ru_maxrss`` (``os.wait4``), and its resident set polled
  every 0.5 s (``psutil``) while it runs, so a run stopped at ``--timeout`` still has one;
- **wall**: the child's, start to exit; each stage's from the child's ``stage_seconds``;
- **s per block**: each stage's last per-block progress bar (``autoprec.stream.progress``:
  ``stage: blocks``, read from the child's stderr): its forward's elapsed time over the
  blocks done (loading and computing them, under the machine's load).

A run stopped at ``--timeout`` (or ``--until HH:MM`` UTC) is recorded as far as it got:
the stage its bar last showed, its peak so far, its seconds per block.

    python -m benchmarks.make_llama_checkpoint --preset 1.1b --out /work/ckpt/llama-1.1b
    python -m benchmarks.tune_streamed /work/ckpt/llama-1.1b --write
    python -m benchmarks.tune_streamed /work/ckpt/llama-8b --targets h100,b200 --until 15:30

``--write`` appends the rows to ``benchmarks/results/tune_streamed.md`` (with the command
and the CPU) rather than replacing it, so runs of different sizes at different times keep
their rows; ``--out FILE`` writes elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS as RESULTS_DIR
from benchmarks.common import ROOT
from benchmarks.tables import cpu_name, load_average, load_line, markdown

RESULTS = RESULTS_DIR / "tune_streamed.md"
#: ``probe: blocks: 45%|####  | 10/22 [00:12<00:14, 1.23s/block, forward 3]``: the stage,
#: the block the forward is at, and the forward's elapsed time (``[H:]MM:SS``)
_BAR = re.compile(r"(\w+): blocks:[^\n]*?\|\s*(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<")


def child(folder: str, target: str, out: str, max_error: float, summary: str,
          batch_size: int | None, trials: int, form: str = "deploy") -> None:
    """In the child process: tune the folder (progress bars on stderr), write the summary."""
    import autoprec
    from autoprec.stream import Checkpoint
    from autoprec.tuning.memory import map_large_allocations

    map_large_allocations()  # as the CLI does at its start (autoprec.cli.main)
    ckpt = Checkpoint(folder)
    cfg = ckpt.config()
    res = autoprec.tune(folder, target=target, out=out, max_error=max_error, progress=True,
                        batch_size=batch_size, trials=trials, form=form)
    rules = res.policy.layers
    data = {
        "params": ckpt.bytes_under("") // 2, "weight_bytes": ckpt.bytes_under(""),
        "blocks": int(getattr(cfg, "num_hidden_layers", 0)), "error": res.plan.eval_error,
        "budget": res.plan.budget, "feasible": res.feasible, "est_speedup": res.est_speedup,
        "est_over_reference": res.policy.metrics.get("est_speedup_over_reference"),
        "default": res.policy.default,
        "formats": {p: sum(1 for v in rules.values() if v == p) for p in set(rules.values())},
        "rules": len(rules), "trials": res.search.trials, "peak_memory": res.costs.peak_memory,
        "memory_stages": dict(res.costs.memory_stages),
        "stage_seconds": dict(res.costs.stage_seconds),
    }
    Path(summary).write_text(json.dumps(data))


def bar_rates(text: str) -> tuple[str | None, dict[str, float]]:
    """The stage the last block bar showed, and each stage's seconds per block: the last
    bar of the stage past its second block, its forward's elapsed time over the blocks
    done (the bar starts, and restarts each forward, when the first block has loaded)."""
    last, rates = None, {}
    for m in _BAR.finditer(text.replace("\r", "\n")):
        last, n = m.group(1), int(m.group(2))
        if n >= 2:
            h, mm, ss = (int(g or 0) for g in m.group(4, 5, 6))
            rates[last] = (3600 * h + 60 * mm + ss) / (n - 1)
    return last, rates


def run_one(folder: Path, target: str, max_error: float, workdir: Path,
            deadline: float | None, batch_size: int | None = None,
            trials: int = 40, form: str = "deploy") -> dict[str, Any]:
    import psutil

    tag = f"{folder.name}-{target}" + ("-train" if form == "train" else "")
    summary, log = workdir / f"{tag}.json", workdir / f"{tag}.stderr"
    cmd = [sys.executable, "-m", "benchmarks.tune_streamed", "--child", str(folder),
           "--targets", target, "--max-error", str(max_error),
           "--policy", str(workdir / f"{tag}.yaml"), "--summary", str(summary)]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    cmd += ["--trials", str(trials), "--form", form]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                cwd=workdir)
        ps, polled, status, ru, stopped = psutil.Process(proc.pid), 0, 0, None, False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            with contextlib.suppress(psutil.Error):  # exiting between wait4 and now
                polled = max(polled, ps.memory_info().rss)
            if deadline is not None and time.time() > deadline and not stopped:
                proc.terminate()
                stopped = True
            time.sleep(0.5)
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    stage, rates = bar_rates(text)
    shown = target + (" (--form train)" if form == "train" else "")
    row: dict[str, Any] = {"model": folder.name, "target": shown, "wall": wall,
                           "rss": max(polled, ru.ru_maxrss * 1024), "rates": rates,
                           "stopped": stopped, "stage": stage, "rc": proc.returncode}
    if summary.is_file():
        row.update(json.loads(summary.read_text()))
    elif not stopped:
        tail = text.replace("\r", "\n").strip().splitlines()[-5:]
        raise SystemExit(f"{tag}: tune failed ({proc.returncode}): " + " / ".join(tail))
    else:
        from autoprec.stream import Checkpoint

        ck = Checkpoint(folder)
        row.update(params=ck.bytes_under("") // 2, weight_bytes=ck.bytes_under(""),
                   blocks=int(getattr(ck.config(), "num_hidden_layers", 0)))
    return row


COLUMNS = ("model", "params", "blocks", "target", "peak RSS GB", "peak / weights", "wall s",
           "fp8 / nvfp4 layers written", "error (budget)", "est. speed-up vs bf16",
           "s per block (stage)", "wall per stage (s)")


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _cells(r: dict[str, Any]) -> list[str]:
    w = r["weight_bytes"]
    per_block = ", ".join(f"{r['rates'][k]:.2f} ({k})" for k in r["rates"]) or "-"
    if r["stopped"] and "error" not in r:
        return [r["model"], _params(r["params"]), str(r["blocks"]), r["target"],
                f"{r['rss'] / 1e9:.2f} (so far)", f"{r['rss'] / w:.2f}x", f"{r['wall']:.0f}",
                f"stopped in stage {r['stage'] or '?'}", "-", "-", per_block, "-"]
    fm = r["formats"]
    return [r["model"], _params(r["params"]), str(r["blocks"]), r["target"],
            f"{r['rss'] / 1e9:.2f}", f"{r['rss'] / w:.2f}x", f"{r['wall']:.0f}",
            f"{fm.get('fp8', 0)} / {fm.get('nvfp4', 0)} (of {r['rules']} rules, default "
            f"{r['default']})", f"{r['error']:.4f} ({r['budget']:g})",
            f"{r['est_over_reference'] or r['est_speedup']:.2f}x", per_block,
            ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items())]


def table(rows: list[dict[str, Any]]) -> str:
    return markdown(COLUMNS, map(_cells, rows))


def _deadline(until: str | None, timeout: float | None) -> float | None:
    ends = []
    if timeout is not None:
        ends.append(time.time() + timeout)
    if until:
        hh, mm = (int(x) for x in until.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        end = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
        ends.append(end.timestamp() if end > now else (end + dt.timedelta(days=1)).timestamp())
    return min(ends) if ends else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders to tune")
    ap.add_argument("--targets", default="h100", help="comma-separated: h100, b200, ...")
    ap.add_argument("--max-error", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, help="price at this many sequences (tune's "
                    "--batch-size; default: the calibration batch's, 1)")
    ap.add_argument("--trials", type=int, default=40, help="trials this run adds to the "
                    "study at most (tune's --trials; a --workdir's study is joined)")
    ap.add_argument("--form", choices=("deploy", "train"), default="deploy",
                    help="tune's --form: train holds the weights in fp32 (the masters)")
    ap.add_argument("--timeout", type=float, help="stop a run after this many seconds")
    ap.add_argument("--until", help="stop a run at this UTC time (HH:MM)")
    ap.add_argument("--write", action="store_true", help=f"append to {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--out", type=Path, help="append the result to this file instead")
    ap.add_argument("--workdir", type=Path, help="keep the runs' policies and logs here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--summary", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(str(args.checkpoints[0]), args.targets, args.policy, args.max_error, args.summary,
              args.batch_size, args.trials, args.form)
        return
    from autoprec.stream import is_checkpoint_dir

    bad = [p for p in args.checkpoints if not is_checkpoint_dir(p)]
    if bad:
        print(f"tune_streamed: {bad[0]}: not a checkpoint folder (no config.json)",
              file=sys.stderr)
        raise SystemExit(2)
    deadline = _deadline(args.until, args.timeout)
    load0, rows = load_average(), []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for folder in args.checkpoints:
            for target in args.targets.split(","):
                row = run_one(folder.resolve(), target.strip(), args.max_error, work, deadline,
                              args.batch_size, args.trials, args.form)
                rows.append(row)
                print(f"{row['model']} {row['target']}: peak RSS {row['rss'] / 1e9:.2f} GB, "
                      f"{row['wall']:.0f} s" + (" (stopped)" if row["stopped"] else ""),
                      flush=True)
    text = "\n".join([table(rows), "", f"{load_line(load0, load_average(), cpu_name())}; "
                      f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"])
    print()
    print(text)
    dest = args.out or (RESULTS if args.write else None)
    if dest is not None:
        cmd = "python -m benchmarks.tune_streamed " + " ".join(
            a if not Path(a).is_dir() else Path(a).name for a in (argv or sys.argv[1:]))
        head = ("# tune_streamed: `autoprec tune DIR` on checkpoints streamed block by block"
                "\n\nRows appended by `python -m benchmarks.tune_streamed DIR... --write` "
                "(see its docstring: random-weight Llamas from "
                "`benchmarks/make_llama_checkpoint.py`, one process per run).\n")
        old = dest.read_text() if dest.is_file() else head
        dest.write_text(old + f"\n## `{cmd}`\n\n{text}\n")


if __name__ == "__main__":
    main()
