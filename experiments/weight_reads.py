"""Where a GEMM's weight comes from: stored (cold) or just cast (hot) (issue 29).

The op timings (``autoprec/cost/op_times.py``) time each GEMM alone. In the model's forward a
stored weight (fp32, or ``model.to(bf16)``'s copy) was last read one forward earlier, and
the forward has moved every other weight and activation since; the training form's 16-bit
GEMM instead reads the cast of its fp32 master it has just written. This replays a model's
Linear layers in their forward order, in one process, and times each GEMM (only the GEMM)
in three ways, interleaved round by round so that a drift of the machine hits all alike
(each timed forward right after a warm-up forward of the same way, as tune times a row):

- ``stored fp32`` / ``stored bf16``: the weights held in that dtype (fp32, the deploy form);
- ``cast, then bf16``: each fp32 weight and bias cast to bf16 right before its GEMM (the
  training form under one autocast);

beside the op timings' two ways of timing one alone: ``hot`` (the same weight every call)
and ``cycled`` (through copies spanning the forward's footprint, ``op_runner._span``).
Freed memory is kept in the heap (``MALLOC_*_THRESHOLD_``, as experiments/page_faults.py's
``kept``) so that no cast's fresh buffer page-faults.

    python experiments/weight_reads.py                    # mixed8
    python experiments/weight_reads.py --models mixed8,encoder4

Timings are this machine's (its CPU is printed); compare within one table only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

KEPT_ENV = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_MMAP_THRESHOLD_": str(4 << 30)}
if any(os.environ.get(k) != v for k, v in KEPT_ENV.items()):  # glibc reads them at start
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEPT_ENV})

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprec.capability import cpu_facts  # noqa: E402
from autoprec.cost.op_measure import _footprint  # noqa: E402
from autoprec.cost.op_runner import _span  # noqa: E402
from autoprec.loading import load_model_file  # noqa: E402
from autoprec.trace import trace  # noqa: E402

ROUNDS = 40
BF16 = torch.bfloat16


def linears(name: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], int]:
    """The model's ``F.linear`` calls in forward order as (input, weight, bias) in fp32, and
    the forward's footprint in bytes (fp32 width)."""
    spec = load_model_file(ROOT / "experiments" / name / "model.py")
    model = spec.model()
    batch = spec.calibration_batches()[0]
    g = trace(model, batch, forward=spec.forward).ops
    params = dict(model.named_parameters())
    out = []
    for op in g.ops:
        r = op.recipe
        if r is None or r["f"] != "F.linear" or len(r["a"]) < 3 or r["a"][2] is None:
            continue
        x, w, b = r["a"][:3]
        wp, bp = g.values[w["t"]].param, g.values[b["t"]].param
        if wp not in params or bp not in params:
            continue
        rows = 1
        for d in x["shape"][:-1]:
            rows *= d
        out.append((torch.randn(rows, x["shape"][-1]), params[wp].detach(),
                    params[bp].detach()))
    return out, _footprint(g, 1.0)


def in_forward(layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
               ) -> dict[str, list[float]]:
    """Seconds of each GEMM in the replayed forward, per way, median over rounds."""
    w16 = [(w.to(BF16), b.to(BF16)) for _, w, b in layers]
    x16 = [x.to(BF16) for x, _, _ in layers]

    def stored(xs: list[torch.Tensor], wbs: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> list[float]:
        out = []
        for x, (w, b) in zip(xs, wbs, strict=True):
            x.mul_(1.0)  # the input hot, as the op that just wrote it leaves it
            t = time.thread_time_ns()
            F.linear(x, w, b)
            out.append(time.thread_time_ns() - t)
        return out

    x32, w32 = [x for x, _, _ in layers], [(w, b) for _, w, b in layers]

    def cast16() -> list[float]:
        out = []
        for x, (_, w, b) in zip(x16, layers, strict=True):
            wc, bc = w.to(BF16), b.to(BF16)
            x.mul_(1.0)
            t = time.thread_time_ns()
            F.linear(x, wc, bc)
            out.append(time.thread_time_ns() - t)
        return out

    ways = {"stored fp32": lambda: stored(x32, w32), "stored bf16": lambda: stored(x16, w16),
            "cast, then bf16": cast16}
    got: dict[str, list[list[float]]] = {k: [] for k in ways}
    for r in range(ROUNDS + 3):
        for k, fn in ways.items():
            fn()  # a warm-up forward first, as tune's timing step runs one per row and round
            one = fn()
            if r >= 3:
                got[k].append(one)
    return {k: [statistics.median(col) / 1e9 for col in zip(*v, strict=True)]
            for k, v in got.items()}


def alone(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, copies: int) -> float:
    ws = [(w.clone(), b.clone()) for _ in range(copies)]
    it = itertools.cycle(ws)

    def call() -> None:
        wc, bc = next(it)
        F.linear(x, wc, bc)

    for _ in range(5):
        call()
    ts = []
    for _ in range(ROUNDS):
        t = time.thread_time_ns()
        call()
        ts.append(time.thread_time_ns() - t)
    return statistics.median(ts) / 1e9


def table(name: str) -> list[str]:
    layers, footprint = linears(name)
    span = _span(footprint)
    fwd = in_forward(layers)
    lines = [f"**{name}**: {len(layers)} Linear calls, footprint {footprint / 2**20:.1f} MB "
             f"(fp32 width), op timings cycle a stored weight through {span / 2**20:.1f} MB",
             "",
             "| GEMM (rows x in -> out) | stored fp32 | stored bf16 | cast, then bf16 | "
             "alone hot fp32 | cycled fp32 | alone hot bf16 | cycled bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    sums = [0.0] * 7
    for k, (x, w, b) in enumerate(layers):
        n = max(1, min(256, -(-span // (w.numel() * 4)))) if span else 1
        x16, w16, b16 = x.to(BF16), w.to(BF16), b.to(BF16)
        row = [fwd["stored fp32"][k], fwd["stored bf16"][k], fwd["cast, then bf16"][k],
               alone(x, w, b, 1), alone(x, w, b, n), alone(x16, w16, b16, 1),
               alone(x16, w16, b16, n)]
        sums = [s + r for s, r in zip(sums, row, strict=True)]
        lines.append(f"| {x.shape[0]} x {w.shape[1]} -> {w.shape[0]} | "
                     + " | ".join(f"{1e6 * s:.0f} us" for s in row) + " |")
    lines.append("| **sum** | " + " | ".join(f"**{1e6 * s:.0f} us**" for s in sums) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mixed8")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if not (ROOT / "experiments" / m / "model.py").is_file()]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}: no experiments/{unknown[0]}/model.py")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"machine: {cpu_facts()}; torch {torch.__version__}; 1 thread, thread CPU time, "
          f"median of {ROUNDS} rounds\n")
    with torch.no_grad():
        for name in names:
            print("\n".join(table(name)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
