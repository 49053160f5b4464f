"""The training form's per-call weight casts: timed alone vs back to back (issue 29).

autoprec's op timing (``autoprec/cost/op_times.py``) times each cast alone. In the training
form a forward casts every weight of a 16-bit region once per call (autocast, its cast cache
on), one after the other, each into a fresh buffer. This script times a model's weight
casts both ways, fp32 -> bf16, on one thread (thread CPU time):

- ``alone``: each weight's cast repeated on its own (a buffer of that size freed and
  reused), summed over the weights, as the op timing prices them;
- ``in model order``: all the weights cast back to back, outputs kept until the last one
  (autocast's cache keeps them through the forward), with the minor page faults per pass.

Each row is a fresh process: ``loaded`` builds the model first (its weights copied, as a
tune process holds a model), ``bare`` makes weights of the same shapes with ``torch.randn``
and loads nothing else, ``bare, primed`` also times one weight's cast alone first (as the op
timing does); each with glibc's malloc thresholds as they are and with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` raised to 4 GB (malloc keeps freed
memory instead of returning it to the OS). Whether the back-to-back casts fault on fresh
pages depends on what the process allocated and freed before: glibc raises its mmap and
trim thresholds after freeing a large block.

    python experiments/weight_casts.py                    # experiments/nn_transformer
    python experiments/weight_casts.py --model minilm

Timings are this machine's (its CPU is printed); ratios within one run only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprec.capability import cpu_facts  # noqa: E402
from autoprec.cost.measure import measure_latency  # noqa: E402
from autoprec.loading import load_model_file  # noqa: E402

_RAISED = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def _seconds(fn: Any, n: int) -> float:
    """Median seconds of one ``fn()`` (thread CPU time, after 10 warm-up calls)."""
    return measure_latency(fn, "cpu", warmup=10, repeats=n, clock="thread").median_s


def _shapes(model_name: str) -> list[list[int]]:
    spec = load_model_file(ROOT / "experiments" / model_name / "model.py")
    return [list(p.shape) for p in spec.model().parameters() if p.dim() >= 2]


def measure(model_name: str, bare: bool) -> tuple[int, float, float, float]:
    """(weights, alone s, in model order s, minor faults per in-order pass). ``bare``: the
    weights made with ``torch.randn`` in a process that loaded nothing else."""
    if bare:
        weights = [torch.randn(*s) for s in json.loads(os.environ["WEIGHT_SHAPES"])]
        if os.environ.get("PRIME_ONE"):  # first, one weight's cast timed alone (1-D, 4 copies)
            copies = itertools.cycle([torch.randn(weights[0].numel()) for _ in range(4)])
            _seconds(lambda: next(copies).to(torch.bfloat16), 300)
    else:
        spec = load_model_file(ROOT / "experiments" / model_name / "model.py")
        weights = [p.detach().float().clone() for p in spec.model().parameters()
                   if p.dim() >= 2]
    alone = 0.0
    for w in weights:
        copies = itertools.cycle([w, w.clone()])
        alone += _seconds(lambda c=copies: next(c).to(torch.bfloat16), 100)

    def in_order() -> list[torch.Tensor]:
        return [w.to(torch.bfloat16) for w in weights]

    n = 50
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    together = _seconds(in_order, n)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (n + 10)
    return len(weights), alone, together, faults


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nn_transformer", help="a folder of experiments/")
    ap.add_argument("--row", choices=("loaded", "bare"), help=argparse.SUPPRESS)  # a run
    args = ap.parse_args(argv)
    if not (ROOT / "experiments" / args.model / "model.py").is_file():
        ap.error(f"--model {args.model!r}: no experiments/{args.model}/model.py")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.row:
        count, alone, together, faults = measure(args.model, args.row == "bare")
        malloc = "4 GB" if "MALLOC_TRIM_THRESHOLD_" in os.environ else "glibc's"
        what = "bare, primed" if os.environ.get("PRIME_ONE") else args.row
        print(f"| {args.model} | {what} | {malloc} | {count} | {alone * 1e3:.3f} "
              f"| {together * 1e3:.3f} | {together / alone:.1f}x | {faults:.1f} |")
        return 0
    print(f"machine: {cpu_facts()}; torch {torch.__version__}; 1 thread, thread CPU time\n")
    print("| model | process | malloc thresholds | weights | alone, summed ms "
          "| in model order ms | ratio | minor faults per pass |")
    print("|---|---|---|---|---|---|---|---|")
    base = {k: v for k, v in os.environ.items() if k not in _RAISED}
    base["WEIGHT_SHAPES"] = json.dumps(_shapes(args.model))
    for row, extra in (("loaded", {}), ("bare", {}), ("bare", {"PRIME_ONE": "1"})):
        for env in ({**base, **extra}, {**base, **extra, **_RAISED}):
            got = subprocess.run([sys.executable, __file__, "--model", args.model, "--row", row],
                                 env=env, capture_output=True, text=True, check=True)
            print(got.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
