"""Page faults of fresh buffers: why one process times the training form 2x slower (issue 29).

The training form casts each fp32 master weight to 16 bits on every forward, into a new
buffer. glibc serves a large buffer from fresh pages of the OS when it returned the last
one (a freed mmap'd chunk, or a heap top trimmed past ``M_TRIM_THRESHOLD``), and every
4 KiB page then faults on first touch. Whether it does depends on what the process
allocated before: the same forward faults in one process and not in another. So tune's
timing step and ``eval --measure`` can disagree on the same plan, which is what issue 29's
1.43x vs 0.79x looked like.

Each row is a fresh process. It times fp32, ``model.to(bf16)`` (the deploy form, no
per-call casts) and one global bf16 autocast (the training form) as tune's timing step
does (``measure_interleaved``: interleaved rounds, one torch thread, thread CPU time),
with the minor page faults per forward (``Samples.faults``), under three settings:

- ``glibc``: the allocator as a process finds it;
- ``trimmed``: ``malloc_trim(0)`` (``cost.measure.allocator_trim``) before every sample
  of 1 + 3 forwards: the sample starts from an allocator that has handed its free memory
  back (tune's cold confirmation trims before every timed forward instead);
- ``kept``: ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` at 4 GB, so freed
  buffers stay in the heap (the non-faulting state, made certain; jemalloc or tcmalloc
  keep them too).

    python experiments/page_faults.py                 # wide, nn_transformer
    python experiments/page_faults.py --models wide

Timings are this machine's (its CPU is printed); compare ratios within one row only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("glibc", "trimmed", "kept")
PLANS = {"fp32": ("fp32", "deploy"), "model.to(bf16)": ("bf16", "deploy"),
         "bf16 autocast": ("bf16", "train")}
KEPT_ENV = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_MMAP_THRESHOLD_": str(4 << 30)}


def child(name: str, setting: str) -> dict[str, Any]:
    """Runs in the fresh process: {plan: (ms per forward, faults per forward)}."""
    sys.path.insert(0, str(ROOT))
    import torch

    from autoprec.apply.apply import apply_policy
    from autoprec.cost.measure import allocator_trim, measure_interleaved
    from autoprec.loading import load_model_file
    from autoprec.policy import Policy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    trim = allocator_trim() if setting == "trimmed" else None
    spec = load_model_file(ROOT / "experiments" / name / "model.py")
    batch = spec.calibration_batches()[0]
    models = {label: spec.model() for label in PLANS}

    def run_of(label: str) -> Any:
        def run() -> Any:
            with torch.no_grad():
                return spec.forward(models[label], batch)
        return run

    @contextlib.contextmanager
    def around(label: str) -> Any:
        default, form = PLANS[label]
        with apply_policy(models[label], Policy(default=default, form=form)):
            if trim is not None:
                trim()
            yield

    got = measure_interleaved({label: run_of(label) for label in PLANS}, "cpu",
                              around={label: (lambda label=label: around(label))
                                      for label in PLANS},
                              rounds=9, warmup=1, inner=3, clock="thread", seed=1)
    return {label: (1e3 * float(np.median(got[label])), float(np.median(got.faults[label])))
            for label in PLANS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="wide,nn_transformer")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in names:
        if not (ROOT / "experiments" / name / "model.py").is_file():
            ap.error(f"--models: no experiments/{name}/model.py")
    sys.path.insert(0, str(ROOT))
    from autoprec.capability import cpu_facts

    print(f"machine: {cpu_facts()}; 1 torch thread, thread CPU time; each row a fresh "
          "process; ms and minor page faults per forward (medians of 9 rounds)\n")
    print("| model | allocator | fp32 ms | model.to(bf16) ms (faults) | bf16 autocast ms "
          "(faults) | model.to(bf16) x | bf16 autocast x |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for setting in SETTINGS:
            env = {**os.environ, **(KEPT_ENV if setting == "kept" else {})}
            out = subprocess.run([sys.executable, __file__, "--child", name, setting],
                                 env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            f32, dep, ac = r["fp32"], r["model.to(bf16)"], r["bf16 autocast"]
            print(f"| {name} | {setting} | {f32[0]:.2f} | {dep[0]:.2f} ({dep[1]:,.0f}) | "
                  f"{ac[0]:.2f} ({ac[1]:,.0f}) | {f32[0] / dep[0]:.2f}x | "
                  f"{f32[0] / ac[0]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
