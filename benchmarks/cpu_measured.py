"""Tuned for the CPU at hand, measured on it: tuned vs fp32 vs one CPU autocast.

For each model, ``autoprec.tuning.tune.tune(..., target="cpu")`` as a user runs it: the
``cpu`` profile is calibrated on this machine first (micro-benchmarks, cached per machine:
``autoprec/evaluation/speed_source.py``), the search prices plans on it, and the last step
times the chosen plan, the next candidates, fp32 and one global bf16 / fp16 autocast,
interleaved (one torch thread, thread CPU time, one calibration batch; median of per-round
ratios to fp32, p10-p90 as the spread: ``autoprec/evaluation/timing.py``), writing the
fastest measured plan within budget. This prints, per model, the written plan's measured
and estimated speed-up beside fp32's and one CPU autocast's, and two checks of the issue:

- ``written / best``: the written plan's measured speed-up over the faster of fp32 and one
  global bf16 autocast (>= 0.95 asked; a baseline over budget does not count);
- ``est / measured``: the printed estimate against the measurement (within 30 % asked).

    python -m benchmarks.cpu_measured                  # minilm, wide, mixed8, digits_cnn
    python -m benchmarks.cpu_measured --out benchmarks/results   # + cpu_measured.md/.csv
    python -m benchmarks.cpu_measured --models mixed8 --trials 5  # quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from autoprec.device.capability import cpu_facts
from autoprec.evaluation.rows import label
from autoprec.tuning.tune import tune
from benchmarks.common import example

#: model -> (budget kind, budget): issue 21's MiniLM at 3 % and wide MLP at 5 %, mixed8 at
#: issue 14's 3 %, the digits CNN at half an accuracy point.
MODELS = {"minilm": ("max_error", 0.03), "wide": ("max_error", 0.05),
          "mixed8": ("max_error", 0.03), "digits_cnn": ("max_drop", 0.005)}


def row_of(name: str, kind: str, budget: float, res: Any, seconds: float) -> dict[str, Any]:
    rows = {r.name: r for r in res.plan.speed.rows}
    tuned, bf16 = rows["tuned"], rows[label("bf16")]
    fp16 = rows.get(label("fp16"))
    win = res.plan.speed.winner
    best = max(1.0, bf16.speedup) if bf16.feasible and bf16.speedup else 1.0
    pol = res.policy
    return {
        "model": name, "budget": f"{kind.replace('max_', '')} {budget:g}",
        "written": f"default {pol.default}, {len(pol.layers)} rules",
        "written_is": win.name if win is not None else "-",
        "error": res.plan.eval_error,
        "tuned_est": tuned.est_speedup, "tuned_measured": tuned.speedup,
        "written_est": win.est_measured_batch if win is not None else None,
        "written_measured": win.speedup if win is not None else None,
        "written_p10": win.p10 if win is not None else None,
        "written_p90": win.p90 if win is not None else None,
        "bf16_error": bf16.error, "bf16_est": bf16.est_measured_batch,
        "bf16_measured": bf16.speedup, "bf16_within": bf16.feasible,
        "fp16_est": fp16.est_measured_batch if fp16 else None,
        "fp16_measured": fp16.speedup if fp16 else None,
        "written_vs_best": (win.speedup / best) if win is not None and win.speedup else None,
        "est_vs_measured": (win.est_measured_batch / win.speedup)
        if win is not None and win.speedup and win.est_measured_batch else None,
        "batch": res.plan.speed.batch_size, "rounds": res.plan.speed.rounds, "seconds": seconds,
        "reason": res.plan.speed.reason,
    }


def table(rows: list[dict[str, Any]]) -> str:
    def x(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}x"

    out = ["| model | budget | written policy | error | written: measured (p10-p90) | "
           "written: est. | fp32 | bf16 autocast: measured / est. (error) | "
           "fp16 autocast: measured / est. | written / best of fp32, bf16 | est. / measured |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bf = (f"{x(r['bf16_measured'])} / {x(r['bf16_est'])} ({r['bf16_error']:.3g}"
              + ("" if r["bf16_within"] else ", over budget") + ")")
        out.append(
            f"| {r['model']} | {r['budget']} | {r['written']} ({r['written_is']}) | "
            f"{r['error']:.3g} | {x(r['written_measured'])} ({r['written_p10']:.2f}-"
            f"{r['written_p90']:.2f}) | {x(r['written_est'])} | 1.00x | {bf} | "
            f"{x(r['fp16_measured'])} / {x(r['fp16_est'])} | "
            f"{'-' if r['written_vs_best'] is None else format(r['written_vs_best'], '.2f')} | "
            f"{'-' if r['est_vs_measured'] is None else format(r['est_vs_measured'], '.2f')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None, help="write cpu_measured.md/.csv here")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        print(f"cpu_measured: unknown model {unknown[0]!r}; known: {', '.join(MODELS)}",
              file=sys.stderr)
        return 2
    rows = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"  # one calibration for all models: the same machine
        for name in names:
            kind, budget = MODELS[name]
            t0 = time.perf_counter()
            res = tune(example(name), **{kind: budget}, target="cpu",
                       trials=args.trials, out=Path(tmp) / f"{name}.yaml", progress=False,
                       cache_dir=cache)
            rows.append(row_of(name, kind, budget, res, time.perf_counter() - t0))
            if not notes:  # the first tune calibrates; the others read its cache
                notes += [n.split("; cached in")[0] for n in res.plan.notes if "profile" in n]
            print(f"{name}: {rows[-1]['reason']}", flush=True)
            print(res.plan.speed.table(), flush=True)
    cmd = " ".join(["python -m benchmarks.cpu_measured",
                    *(argv if argv is not None else sys.argv[1:])])
    header = [f"machine: {cpu_facts()}; torch {torch.__version__}",
              "timing: one torch thread, thread CPU time, one calibration batch, interleaved "
              "rounds (median of per-round ratios to fp32; p10-p90 in brackets)",
              *notes, f"made by `{cmd}`"]
    text = "\n".join(f"- {h}" for h in header) + "\n\n" + table(rows)
    print(text)
    if args.out is not None:
        import pandas as pd

        args.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out / "cpu_measured.csv", index=False)
        (args.out / "cpu_measured.md").write_text(
            "# Tuned for this CPU, measured on it (issue 21)\n\n" + text + "\n")
        print(f"wrote {args.out / 'cpu_measured.md'}, .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
