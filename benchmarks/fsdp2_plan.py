"""A training plan under FSDP2 on CPU gloo ranks against one process: losses and memory.

The model, plan and data are tests/helpers/dist.py's (a residual MLP; fp32 embed and head,
block 0 bf16 with its fc1 fp8, block 1 fp16 with a GradScaler and its fc1 mxfp8). The
plan is applied with ``prepare_training``, then FSDP2 ``fully_shard`` shards each block and
the root (torchtitan's order). Each step's global batch is split between the ranks (``split``), or given whole to
every rank (``replicated``: the same arithmetic as one process). Prints the loss of every
step (one process; rank 0's global loss, the mean of the ranks' local losses) with the
relative difference, and per process its peak RSS and the bytes it holds of the
parameters, gradients and AdamW state. Writes ``results/fsdp2_plan.md``.

    python -m benchmarks.fsdp2_plan [--world 2] [--steps 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS
from benchmarks.tables import cpu_name, markdown
from tests.helpers import dist as D


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _one_process(steps: int, rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """The rank program of the single process (a 1-rank group, no engine)."""
    model = D.build()
    with D.prepare_training(model, D.policy()) as setup:
        opt = torch.optim.AdamW(model.parameters(), lr=D.LR)
        losses = [D.train_step(setup, opt, b, D.loss_fn, D.forward).loss
                  for b in D.data(steps)]
        return {"losses": losses, "state": D.local_state_bytes(model, opt),
                "rss": _peak_rss_mb()}


def _fsdp2(steps: int, rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """The rank program under FSDP2: split, then replicated batches."""
    out: dict[str, Any] = {}
    for replicated in (False, True):
        model, setup = D.fsdp2_setup()
        opt = torch.optim.AdamW(model.parameters(), lr=D.LR)
        out["replicated" if replicated else "split"] = D.train(
            model, setup, opt, rank, world, D.data(steps), replicated)
        if not replicated:
            out["state"] = D.local_state_bytes(model, opt)
        setup.remove()
    out["rss"] = _peak_rss_mb()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="FSDP2 ranks (gloo, CPU)")
    ap.add_argument("--steps", type=int, default=D.STEPS)
    ap.add_argument("--out", type=Path, default=RESULTS / "fsdp2_plan.md")
    args = ap.parse_args(argv)
    if args.world < 1 or D.GLOBAL_BATCH % args.world:
        print(f"fsdp2_plan: --world must divide the global batch {D.GLOBAL_BATCH}, got "
              f"{args.world}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", module="torch.distributed")
    with tempfile.TemporaryDirectory() as tmp:
        one = D.run_ranks(partial(_one_process, args.steps), Path(tmp), world=1)[0]
        ranks = D.run_ranks(partial(_fsdp2, args.steps), Path(tmp), world=args.world)
    same = all(r["split"] == ranks[0]["split"] and r["replicated"] == ranks[0]["replicated"]
               for r in ranks)

    def rel(a: float, b: float) -> str:
        return f"{abs(a - b) / abs(b):.1e}"

    rows = [(i + 1, f"{a:.6f}", f"{s:.6f}", rel(s, a), f"{r:.6f}", rel(r, a))
            for i, (a, s, r) in enumerate(zip(one["losses"], ranks[0]["split"],
                                              ranks[0]["replicated"]))]
    losses = markdown(["step", "loss, 1 process", "loss, rank 0 (split)", "rel diff",
                       "loss, rank 0 (replicated)", "rel diff"], rows)
    mem = markdown(["process", "peak RSS (MB)", "params + grads + AdamW state (KB)"],
                   [("1 process", f"{one['rss']:.0f}", f"{one['state'] / 1024:.1f}"),
                    *((f"FSDP2 rank {i}", f"{r['rss']:.0f}", f"{r['state'] / 1024:.1f}")
                      for i, r in enumerate(ranks))])
    text = "\n".join([
        f"# A training plan under FSDP2 ({args.world} gloo ranks) vs one process", "",
        f"`python -m benchmarks.fsdp2_plan --world {args.world} --steps {args.steps}`; "
        f"CPU: {cpu_name()}; torch {torch.__version__}.", "",
        "Plan (tests/helpers/dist.py): fp32 embed and head, `blocks.0` bf16 with "
        "`blocks.0.fc1` fp8 (emulated: e4m3 forward, e5m2 gradients), `blocks.1` fp16 "
        "(GradScaler) with `blocks.1.fc1` mxfp8 (emulated). `prepare_training`, then "
        "`fully_shard` per block, then the root; "
        f"global batch {D.GLOBAL_BATCH}, AdamW lr {D.LR}. Loss: the global batch's "
        "(the mean of the ranks' local losses, all-reduced). "
        f"Every rank reports the same losses: {'yes' if same else 'NO'}.", "",
        losses, "",
        "*split*: each rank trains on its half of the global batch; most of the "
        "difference is the quantised layers': fp8's per-tensor scale is the amax of the "
        "half each rank sees, mxfp8's weight-gradient GEMM takes its blocks of 32 along "
        "the tokens (the same plan without them ran within 1e-4 of one process: "
        "summation order, the gradients averaged over the ranks). "
        "*replicated*: every rank gets the whole batch, the single process's arithmetic.",
        "",
        mem, "",
        "Peak RSS is the whole process (torch, autoprec and the gloo group: the model is "
        "a few KB); the state column is what FSDP2 shards (each rank holds its shard of "
        "every parameter, gradient and AdamW moment).", ""])
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
