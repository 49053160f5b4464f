"""Training steps measured on this CPU against the step's estimate: time and peak memory.

For the digits CNN (``examples/digits_cnn/model.py``, loaded as ``autoprec tune`` loads
it) and a small GPT-2 config built here (random init; 256 wide, 2 blocks, 8 x 128 tokens),
each plan runs real training steps — forward, model.py's loss, backward, AdamW (torch's CPU
default); a GradScaler with fp16 — timed by tune's own interleaved timer
(``evaluation.timing.step_timer``: one torch thread, thread CPU time, rounds in random order),
and one step's allocator peak is measured (``measure.training_step.step_peak_bytes``). Beside
them, the estimate of ``tune --form train --target cpu``: this machine's calibrated cpu
profile and the model's op timings (``Target.cost_model``, ``cost.step``).

Plans: fp32; one global bf16 autocast (``TrainingArguments(bf16=True)``); one global fp16
autocast with a GradScaler (``fp16=True``); and a mixed plan — bf16 with the first and last
GEMM layers kept fp32 (the shape tuned plans take) — or the policy given with ``--policy``.

    .venv/bin/python benchmarks/train_step_cpu.py [--models digits,gpt2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from autoprec.apply.apply import apply_policy
from autoprec.evaluation.target import resolve_target
from autoprec.evaluation.timing import step_timer
from autoprec.loading import load_model_file
from autoprec.measure import live_bytes, step_peak_bytes, training_step, uses_fp16
from autoprec.policy import Policy, gemm_leaf_paths, load_policy
from autoprec.trace import trace

ROOT = Path(__file__).resolve().parents[1]
#: the cpu profile calibrated here, cached between runs (outside the repository)
CACHE = Path(tempfile.gettempdir()) / "autoprec-benchmarks" / "calibration"


def digits() -> tuple:
    spec = load_model_file(ROOT / "examples" / "digits_cnn" / "model.py")
    return ("digits CNN (batch 64)", spec.model(), spec.forward, spec.loss,
            spec.calibration_batches()[0])


def gpt2() -> tuple:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, n_positions=128,
                     use_cache=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (8, 128))  # (B, T)

    def fwd(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(input_ids=b).logits  # (B, T, V)

    def loss(out: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # next-token LM loss
        return F.cross_entropy(out[:, :-1].float().flatten(0, 1), b[:, 1:].flatten())

    return "GPT-2 (256 wide, 2 blocks, 8 x 128 tokens)", GPT2LMHeadModel(cfg).eval(), fwd, \
        loss, ids


MODELS = {"digits": digits, "gpt2": gpt2}


def plans(model: torch.nn.Module, given: Path | None) -> dict[str, Policy]:
    leaves = gemm_leaf_paths(model)
    mixed = (load_policy(given, model=model) if given is not None else
             Policy(default="bf16", layers={leaves[0]: "fp32", leaves[-1]: "fp32"}))
    mixed.form = "train"
    return {"fp32": Policy(default="fp32"), "bf16 autocast": Policy(default="bf16"),
            "fp16 autocast + GradScaler": Policy(default="fp16"),
            "plan (bf16, first/last GEMM fp32)" if given is None else f"plan ({given})": mixed}


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Model name")), "unknown CPU")


def run(key: str, given: Path | None) -> list[str]:
    name, model, fwd, loss, batch = MODELS[key]()
    target = resolve_target("cpu", form="train", measure=True, cache_dir=CACHE)
    graph = trace(model, batch, forward=fwd, tracers=("hooks",))
    cost = target.cost_model(graph, graph.batch_size)
    pols = plans(model, given)
    timer = step_timer(model, fwd, loss, batch, target, inner=1, seed=0, force=True)
    samples = timer(pols)
    rows = [f"\n### {name}\n",
            "| plan | measured ms (p10-p90) | est. ms | est/measured | measured peak MB | "
            "est. peak MB | est/measured |", "|---|---|---|---|---|---|---|"]
    ref = float(np.median(samples["fp32"]))
    for label, pol in pols.items():
        s = np.asarray(samples[label]) * 1e3
        est_s = cost.estimate(pol)
        step = training_step(model, fwd, loss, batch, fp16=uses_fp16(pol))
        with apply_policy(model, pol, target="cpu", force=True):
            step()
            model.zero_grad(set_to_none=True)
            peak = step_peak_bytes(step, live_bytes(model, step.optimizer.state))
        est_mem = cost.train_memory(pol).peak_bytes
        med = float(np.median(s))
        rows.append(f"| {label} | {med:.1f} ({np.percentile(s, 10):.1f}-"
                    f"{np.percentile(s, 90):.1f}); {ref * 1e3 / med:.2f}x | {est_s * 1e3:.1f}; "
                    f"{cost.fp32_time / est_s:.2f}x | {est_s * 1e3 / med:.2f} | "
                    f"{peak / 1e6:.1f} | {est_mem / 1e6:.1f} | {est_mem / peak:.2f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,gpt2")
    ap.add_argument("--policy", type=Path, default=None, help="the plan to measure")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    out = [f"# Training steps on this CPU (command: `python benchmarks/train_step_cpu.py "
           f"--models {args.models}`)", "",
           f"CPU: {cpu_name()}; torch {torch.__version__}; 1 torch thread, thread CPU time; "
           f"load average {load:.1f} when started. Steps: forward, loss, backward, AdamW "
           "(torch's CPU default); estimates: the calibrated cpu profile + this model's op "
           "timings (what `tune --form train --target cpu` prices)."]
    for key in args.models.split(","):
        out += run(key, args.policy)
    print("\n".join(out))
    if args.out is not None:
        args.out.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
