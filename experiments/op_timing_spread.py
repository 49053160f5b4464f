"""How far the CPU estimate itself moves between back-to-back op timings (issue 29).

The estimate of a local CPU target prices each op at its time measured here
(``autoprec/cost/op_times.py``), at one moment; tune's timing step measures the rows at
another. This measures a model's op timings ``--repeats`` times back to back in one process
and prices each baseline row with each, with this machine's calibrated profile (as tune
does; cached under ``--cache``): the range of those estimates (speed-up over fp32) is the
part of |est / measured - 1| that is the machine's drift, not the model.

    python experiments/op_timing_spread.py                       # trap, mixed8, encoder4
    python experiments/op_timing_spread.py --models trap --repeats 5

Timings are this machine's (its CPU is printed).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprec.capability import cpu_facts  # noqa: E402
from autoprec.cost.compiled import make_cost_model  # noqa: E402
from autoprec.cost.op_measure import measure  # noqa: E402
from autoprec.evaluation.speed_source import speed_source  # noqa: E402
from autoprec.loading import load_model_file  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.trace import trace  # noqa: E402

ROWS = {"bf16 (model.to(bfloat16))": Policy(default="bf16", form="deploy"),
        "bf16 (one global autocast)": Policy(default="bf16"),
        "fp16 (model.to(float16))": Policy(default="fp16", form="deploy")}


def spread(name: str, repeats: int, mode: str, cache: Path) -> list[str]:
    spec = load_model_file(ROOT / "experiments" / name / "model.py")
    g = trace(spec.model(), spec.calibration_batches()[0], forward=spec.forward)
    prof = speed_source("cpu", measure=True, cache_dir=cache, mode=mode).profile
    got: dict[str, list[float]] = {k: [] for k in ROWS}
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        times = measure(g.ops, g.batch_size)
        took.append(time.perf_counter() - t0)
        for label, pol in ROWS.items():
            cost = make_cost_model(g, prof, g.batch_size, mode, op_times=times, form=pol.form)
            got[label].append(cost.speedup(pol))
    out = []
    for label, xs in got.items():
        mid = sorted(xs)[len(xs) // 2]
        out.append(f"| {name} | {mode} | {label} | " + ", ".join(f"{x:.2f}x" for x in xs)
                   + f" | {min(xs):.2f}-{max(xs):.2f}x | "
                   f"{100 * (max(xs) - min(xs)) / mid:.0f}% | {sum(took) / len(took):.1f} s |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="trap,mixed8,encoder4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--cache", type=Path, default=Path(".autoprec_cache") / "op_timing_spread",
                    help="where this machine's calibration is cached (as tune's)")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if not (ROOT / "experiments" / m / "model.py").is_file()]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}: no experiments/{unknown[0]}/model.py")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"machine: {cpu_facts()}; torch {torch.__version__}; one torch thread\n")
    print("| model | mode | row | estimate per op timing, in order | range | range / median "
          "| one op timing |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        print("\n".join(spread(name, args.repeats, args.mode, args.cache)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
