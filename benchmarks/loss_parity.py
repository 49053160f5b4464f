"""Loss parity of a tuned training plan: all-MiniLM-L6-v2 fine-tuned as a masked LM on the
docstrings of Python's standard library (examples/minilm_mlm/model.py), under fp32, one
global bf16 autocast (``TrainingArguments(bf16=True)``) and the plan a ``--train-aware``
tune wrote — the same initial weights, seed and batches — with the eval loss on held-out
docstrings every ``--eval-every`` steps. Prints a table (and writes it as markdown) and
plots the eval-loss curves beside it.

    nice python -m benchmarks.loss_parity --policy PLAN.yaml --steps 200 --out benchmarks/results

The runs train under ``autoprec.training.train.prepare_training`` (fp32 masters, a GradScaler iff
the plan has fp16). 16-bit GEMMs this CPU has no fast kernel for run through
``lower/wide16`` (fp32 GEMMs of the 16-bit operands, rounded to 16 bits: the numerics of
tensor cores), so a column of seconds per step is wall time here, not the plan's speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autoprec.lower.wide16 import scoring_gemms, slow_dtypes
from autoprec.policy import Policy, load_policy
from autoprec.training.short_run import eval_loss
from autoprec.training.train import prepare_training, train_step
from benchmarks.common import load_example


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    extra = [f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags.split()]
    return (names[0] if names else "unknown CPU") + (f" ({', '.join(extra)})" if extra else "")


def minilm_mlm() -> Any:
    """examples/minilm_mlm/model.py, imported as the CLI loads it (``benchmarks.common``):
    the module itself, for its ``train_batches`` beside the model.py contract."""
    return sys.modules[load_example("minilm_mlm").build_model.__module__]


def run(label: str, policy: Policy | None, init: torch.nn.Module, batches: list[Any],
        evals: list[Any], steps: int, lr: float, every: int, seed: int) -> dict[str, Any]:
    """One fine-tune: (step, eval loss) points, train losses, skipped steps, seconds/step."""
    mlm = minilm_mlm()
    model = copy.deepcopy(init)
    setup = prepare_training(model, policy) if policy is not None else None
    torch.manual_seed(seed)  # the same dropout masks in every run
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    curve = [(0, eval_loss(model, evals, mlm.forward, mlm.loss))]
    losses, skipped, spent = [], 0, 0.0
    try:
        with scoring_gemms():
            for i in range(steps):
                t0 = time.perf_counter()
                if setup is None:
                    opt.zero_grad(set_to_none=True)
                    loss = mlm.loss(mlm.forward(model, batches[i % len(batches)]),
                                    batches[i % len(batches)])
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
                else:
                    res = train_step(setup, opt, batches[i % len(batches)], mlm.loss,
                                     forward=mlm.forward)
                    losses.append(res.loss)
                    skipped += int(res.skipped)
                spent += time.perf_counter() - t0
                if (i + 1) % every == 0 or i + 1 == steps:
                    curve.append((i + 1, eval_loss(model, evals, mlm.forward, mlm.loss)))
                    print(f"  {label}: step {i + 1}/{steps} eval loss {curve[-1][1]:.4f} "
                          f"({spent / (i + 1):.2f} s/step)", flush=True)
    finally:
        if setup is not None:
            setup.remove()
    return {"label": label, "curve": curve, "losses": losses, "skipped": skipped,
            "s_per_step": spent / steps}


def table(runs: list[dict[str, Any]]) -> list[str]:
    ref = runs[0]["curve"]
    lines = ["| run | final eval loss | gap to fp32 | largest gap over the run | "
             "mean train loss, last 20 steps | skipped steps | s/step here |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        final = r["curve"][-1][1]
        gaps = [(b - a) / abs(a) for (_, a), (_, b) in zip(ref, r["curve"])]
        worst = max(gaps, key=abs)
        tail = r["losses"][-20:]
        lines.append(f"| {r['label']} | {final:.4f} | {gaps[-1]:+.2%} | {worst:+.2%} | "
                     f"{sum(tail) / len(tail):.4f} | {r['skipped']} | {r['s_per_step']:.2f} |")
    return lines


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r, style in zip(runs, ("-", "--", ":")):
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, style, marker="o", ms=3, label=r["label"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("eval loss (held-out docstrings)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


RUNS = ("fp32", "bf16", "plan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, required=True, help="the --train-aware tune's plan")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=4, help="sequences per training batch")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=RUNS, default=None,
                    help="run only this one (its result is kept in OUT/loss_parity_runs/; the "
                         "table is written once all three are there)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mlm = minilm_mlm()
    init = mlm.build_model()
    plan = load_policy(args.policy, init) if args.only in (None, "plan") or args.policy.exists() \
        else None
    batches = mlm.train_batches(args.steps, rows=args.rows, seq_len=args.seq_len)
    evals = mlm.eval_data()
    configs = {"fp32": ("fp32", None),
               "bf16": ("bf16 autocast (bf16=True)", Policy(default="bf16", form="train")),
               "plan": (f"tuned plan ({args.policy.name})", plan)}
    if plan is None:
        configs.pop("plan")
    keep = args.out / "loss_parity_runs"
    keep.mkdir(parents=True, exist_ok=True)
    setting = {"steps": args.steps, "rows": args.rows, "seq_len": args.seq_len, "lr": args.lr,
               "eval_every": args.eval_every, "seed": args.seed, "threads": args.threads,
               "policy": str(args.policy)}
    for key in RUNS if args.only is None else (args.only,):
        label, pol = configs[key]
        r = run(label, pol, init, batches, evals, args.steps, args.lr, args.eval_every,
                args.seed)
        (keep / f"{key}.json").write_text(json.dumps({"setting": setting, **r}), "utf-8")
    runs = []
    for key in RUNS:
        f = keep / f"{key}.json"
        data = json.loads(f.read_text("utf-8")) if f.exists() else None
        if data is None or data.pop("setting") != setting:
            print(f"{key}: not run with these settings yet (--only {key})")
            return
        runs.append(data)
    write(args, plan or load_policy(args.policy, init), evals, runs)


def write(args: Any, plan: Policy, evals: list[Any], runs: list[dict[str, Any]]) -> None:
    png = args.out / "loss_parity_minilm.png"
    md = args.out / "loss_parity_minilm.md"
    wall = sum(r["s_per_step"] for r in runs) * args.steps
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    head = [
        "# Loss parity: MiniLM fine-tuned as a masked LM on the standard library's docstrings",
        "",
        f"`python -m benchmarks.loss_parity --policy {args.policy} --steps {args.steps} "
        f"--rows {args.rows} --seq-len {args.seq_len} --lr {args.lr:g} "
        f"--eval-every {args.eval_every}`",
        "",
        f"CPU: {cpu_name()}, {args.threads} torch thread(s), load average "
        f"{' '.join(load)} at the end (a shared 2-core machine); torch {torch.__version__}, "
        f"Python {platform.python_version()}. 16-bit GEMMs computed wide here (lower/wide16): "
        f"{', '.join(str(d).replace('torch.', '') for d in sorted(slow_dtypes(), key=str)) or 'none'}.",
        "",
        f"{args.steps} AdamW steps (lr {args.lr:g}) from one init (the pretrained encoder, the "
        f"MLM head's transform initialised with seed 0), the same {args.steps} batches of "
        f"{args.rows}x{args.seq_len} tokens in the same order, seed {args.seed}; eval loss: "
        f"mean MLM cross-entropy over {len(evals)} held-out batches (8x64 tokens of other "
        "modules' docstrings), every "
        f"{args.eval_every} steps. The plan: `default: {plan.default}` with "
        f"{len(plan.layers)} rules ({', '.join(sorted(set(plan.layers.values()))) or 'none'}).",
        "",
    ]
    rows = table(runs)
    curve = ["", "Eval loss by step:", "",
             "| step | " + " | ".join(r["label"] for r in runs) + " |",
             "|---" * (len(runs) + 1) + "|"]
    for j, (step, _) in enumerate(runs[0]["curve"]):
        curve.append(f"| {step} | " + " | ".join(f"{r['curve'][j][1]:.4f}" for r in runs) + " |")
    text = "\n".join(head + rows + curve + ["", f"![eval loss]({png.name})",
                                            "", f"Training time of the three runs: {wall:.0f} s "
                                                f"(wall, under the load above). The s/step column is wall time of "
                                                f"runs that may have run at different times "
                                                f"(--only) under a shared machine's load: it "
                                                f"compares nothing; speed is tune's and eval's."])
    md.write_text(text + "\n", encoding="utf-8")
    plot(runs, png, f"MiniLM MLM fine-tune, {args.steps} steps: eval loss")
    print("\n".join(rows))
    print(f"wrote {md} and {png}")
    if not all(math.isfinite(r["curve"][-1][1]) for r in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
