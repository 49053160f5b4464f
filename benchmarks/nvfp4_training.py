"""NVFP4 training against fp32 and bf16: all-MiniLM-L6-v2 fine-tuned as a masked LM on the
docstrings of Python's standard library (examples/minilm_mlm/model.py), the same initial
weights, seed and batches under fp32, one bf16 autocast, NVFP4 everywhere and NVFP4 with a
bf16 tail; prints the eval-loss gaps to fp32 as a table and writes it as markdown.

    nice python -m benchmarks.nvfp4_training --steps 200 --out benchmarks/results

The NVFP4 runs are the fixed recipes of ``autoprec.evaluation.recipes`` ("nvfp4": every
eligible Linear but the LM head; "nvfp4-tail": the last ceil(0.15 L) blocks and the head in
bf16, torchtitan's ``llama3_8b_nvfp4_mixed``), the rest under one bf16 autocast, trained
with ``prepare_training``: NVIDIA's NVFP4 recipe emulated (``lower.nvfp4_train``: 1x16
blocks for X and dY, 16x16 weight tiles, stochastic rounding of dY, a random Hadamard
transform on the wgrad operands) over fp32 masters. ``--toy`` runs a few steps of tiny
batches (a smoke test). Each finished run is kept in ``OUT/nvfp4_training_runs/`` and reused
by a re-run with the same settings (a cut-off run resumes). Seconds per step are wall time of emulations on this CPU: they
say nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from autoprec.evaluation.recipes import recipe_plans
from autoprec.lower.wide16 import slow_dtypes
from autoprec.policy import Policy
from autoprec.trace import trace
from benchmarks.loss_parity import cpu_name, minilm_mlm, run, table

#: run key -> (label, recipe key or None)
RUNS = {"fp32": ("fp32", None), "bf16": ("bf16 autocast", None),
        "nvfp4": ("NVFP4 everywhere (head bf16)", "nvfp4"),
        "nvfp4-tail": ("NVFP4 + bf16 tail", "nvfp4-tail")}


def policies(init: torch.nn.Module, batch: Any, forward: Any) -> dict[str, Policy | None]:
    """Each run's policy: fp32 none, bf16 one autocast, the two NVFP4 recipes as
    ``recipe_plans`` builds them from the model's traced graph."""
    graph = trace(init, batch, forward=forward, tracers=("hooks",))
    plans = {p.recipe.key: p for p in recipe_plans(init, graph, keys=("nvfp4", "nvfp4-tail"))}
    return {"fp32": None, "bf16": Policy(default="bf16", form="train"),
            "nvfp4": plans["nvfp4"].policy, "nvfp4-tail": plans["nvfp4-tail"].policy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=4, help="sequences per training batch")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--toy", action="store_true", help="4 steps of 2x16 tokens (a smoke test)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if args.toy:
        args.steps, args.rows, args.seq_len, args.eval_every = 4, 2, 16, 2
    torch.set_num_threads(args.threads)
    mlm = minilm_mlm()
    init = mlm.build_model()
    batches = mlm.train_batches(args.steps, rows=args.rows, seq_len=args.seq_len)
    evals = mlm.eval_data()[:1] if args.toy else mlm.eval_data()
    pols = policies(init, batches[0], mlm.forward)
    setting = {"steps": args.steps, "rows": args.rows, "seq_len": args.seq_len, "lr": args.lr,
               "eval_every": args.eval_every, "seed": args.seed, "threads": args.threads}
    keep = args.out / "nvfp4_training_runs"  # each finished run, so a cut-off one resumes
    keep.mkdir(parents=True, exist_ok=True)
    runs = []
    for key, (label, _) in RUNS.items():
        f = keep / f"{key}.json"
        data = json.loads(f.read_text("utf-8")) if f.exists() else {}
        if data.pop("setting", None) != setting:
            t0 = time.perf_counter()
            data = run(label, pols[key], init, batches, evals, args.steps, args.lr,
                       args.eval_every, args.seed)
            data["wall_s"] = time.perf_counter() - t0
            f.write_text(json.dumps({"setting": setting, **data}), "utf-8")
        runs.append(data)
    write(args, pols, evals, runs, sum(r["wall_s"] for r in runs))
    if not all(math.isfinite(r["curve"][-1][1]) for r in runs):
        raise SystemExit(1)


def write(args: Any, pols: dict[str, Policy | None], evals: list[Any],
          runs: list[dict[str, Any]], wall: float) -> None:
    rows = table(runs)
    cmd = (f"python -m benchmarks.nvfp4_training --steps {args.steps} --rows {args.rows} "
           f"--seq-len {args.seq_len} --lr {args.lr:g} --eval-every {args.eval_every} "
           f"--seed {args.seed} --threads {args.threads}")
    n_fp4 = {k: len(p.layers) for k, p in pols.items() if p is not None and p.layers}
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    head = [
        "# NVFP4 training (emulated) vs fp32 and bf16: MiniLM masked-LM fine-tune",
        "",
        f"`{cmd}`",
        "",
        f"CPU: {cpu_name()}, {args.threads} torch thread(s), load average {' '.join(load)} "
        f"at the end (a shared machine); torch {torch.__version__}, Python "
        f"{platform.python_version()}. 16-bit GEMMs computed wide here (lower/wide16): "
        f"{', '.join(str(d).replace('torch.', '') for d in sorted(slow_dtypes(), key=str)) or 'none'}.",
        "",
        f"{args.steps} AdamW steps (lr {args.lr:g}) from one init (the pretrained encoder, "
        f"the MLM head's transform from seed 0), the same batches of {args.rows}x{args.seq_len} "
        f"tokens in the same order, seed {args.seed}; eval loss: mean MLM cross-entropy over "
        f"{len(evals)} held-out batches of 8x64 tokens, every {args.eval_every} steps. NVFP4 "
        f"Linears: {n_fp4.get('nvfp4', 0)} (everywhere), {n_fp4.get('nvfp4-tail', 0)} (tail "
        "recipe); everything else under one bf16 autocast. NVFP4 is NVIDIA's training recipe "
        "emulated in fp32 (`autoprec/lower/nvfp4_train.py`).",
        "",
    ]
    curve = ["", "Eval loss by step:", "",
             "| step | " + " | ".join(r["label"] for r in runs) + " |",
             "|---" * (len(runs) + 1) + "|"]
    for j, (step, _) in enumerate(runs[0]["curve"]):
        curve.append(f"| {step} | " + " | ".join(f"{r['curve'][j][1]:.4f}" for r in runs) + " |")
    tail = ["", f"Wall time of the four runs: {wall:.0f} s (evals included). The s/step column is wall time of "
                "emulations under a shared machine's load: it compares nothing about speed."]
    text = "\n".join(head + rows + curve + tail)
    print("\n".join(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "nvfp4_training.md"
    md.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
