"""The fixed training recipes people copy, priced as whole training steps: Llama-3 8B and 70B
on the B200 and H100 profiles, beside torchtitan's and torchao's measured ratios.

Each model is built from its transformers ``LlamaConfig`` on the meta device (no weights,
no memory) and traced shape-only at full depth (``autoprec.trace.shape_only``: the forward's
ops and shapes, the batch's token ids real); the loss (cross-entropy over fp32 logits, as
torchtitan computes it) is recorded the same way. Every plan is priced as autoprec prices a
``--form train`` plan (``make_cost_model(..., step=True)``: forward, backward dgrad + wgrad
at the precision each GEMM runs, every cast and quantise pass, the loss, fused AdamW over
the fp32 masters), eager (autoprec's default) and as ``torch.compile`` runs the forward
(``mode="compile"``; torchtitan's runs were compiled), at torchtitan's NVFP4 benchmark shape:
a local batch of 32 sequences of 2,048 tokens per GPU.

The plans: ``fp32`` (no autocast), ``bf16 autocast`` (one global autocast over fp32 masters,
what ``TrainingArguments(bf16=True)`` runs), and every recipe of
``autoprec.evaluation.recipes`` the profile can run (``recipe_plans``: torchtitan's MXFP8 and
NVFP4 with and without the bf16 tail, Megatron's first/last bf16 with fp8 or MXFP8 between,
torchao's auto filter, fp8 everywhere). Printed per plan: the step, its ratio to bf16
autocast (eager and compiled), where the time goes — GEMMs (fprop + dgrad + wgrad: the
Linears' and fused attention's), casts + quantisation (autocast's casts, the formats'
scaling passes), the rest (norms, activations, RoPE, residual adds, the loss, the
optimizer) — and the measured ratio where a library published one; for the measured runs,
their step time against the priced one. ``--tuned MODEL=POLICY``: a policy ``autoprec tune
--form train`` wrote for that model is priced as one more row, on the devices that run its
precisions.

    .venv/bin/python -m benchmarks.recipes_priced [--models llama3-8b,llama3-70b] [--out FILE.md]
        [--tuned llama3-8b=benchmarks/results/policies/llama-8b-b200-train.yaml]
    .venv/bin/python -m benchmarks.recipes_priced --toy   # a 4-block, 256-wide smoke run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from autoprec.cost import get_profile
from autoprec.cost.model import make_cost_model
from autoprec.evaluation.recipes import recipe_plans
from autoprec.policy import Policy, load_policy
from benchmarks.common import RESULTS, ROOT, choose
from benchmarks.tables import cpu_name, markdown


@dataclass(frozen=True)
class Config:
    """A Llama-3 shape (``transformers.LlamaConfig``'s fields) and the step it is priced at."""

    hidden: int
    layers: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int = 2048
    batch: int = 32  # sequences per GPU per step (torchtitan's local batch size)


MODELS = {
    "llama3-8b": Config(4096, 32, 14336, 32, 8, 128256),
    "llama3-70b": Config(8192, 80, 28672, 64, 8, 128256),
}
#: the smoke run: every dim a multiple of 128 (NVFP4's), 4 blocks (the tail keeps one)
TOY = {"toy": Config(256, 4, 512, 4, 2, 1024, seq=64, batch=4)}
DEVICES = ("b200", "h100")
#: measured step-time ratios over bf16 (model, device) -> recipe key -> (ratio, what ran)
MEASURED: dict[tuple[str, str], dict[str, tuple[float, str]]] = {
    ("llama3-8b", "b200"): {
        "bf16": (1.00, "torchtitan bf16, 21,919 tok/s/GPU"),
        "mxfp8": (1.28, "torchtitan MXFP8, 28,084"),
        "nvfp4-tail": (1.37, "torchtitan NVFP4 + bf16 tail, 30,040"),
        "nvfp4": (1.45, "torchtitan NVFP4 all blocks, 31,758"),
    },
    ("llama3-8b", "h100"): {
        "fp8": (1.25, "torchao float8 tensorwise via torchtitan (LM head bf16, fp8 "
                      "all-gather), 8 GPUs"),
        "torchao-rowwise": (1.10, "torchao float8 rowwise via torchtitan, no shape filter, "
                                  "8 GPUs"),
    },
}
#: the measured runs' throughput, tokens per second per GPU (the step: batch x seq / this)
TOKENS_PER_S: dict[tuple[str, str], dict[str, float]] = {
    ("llama3-8b", "b200"): {"bf16": 21919, "mxfp8": 28084, "nvfp4-tail": 30040,
                            "nvfp4": 31758}}
#: what a row's figures do not show
NOTES = {"torchao-rowwise": "its filter is rowwise's; its scaling is priced as tensorwise "
                            "(autoprec prices fp8 as per-tensor current scaling), so its "
                            "step is tensorwise's on the same layers"}
SOURCES = (
    "torchtitan `docs/nvfp4.md` (Llama-3 8B, 4 B200, FSDP 4, local batch 32 x 2,048, "
    "torch.compile, tokens/s per GPU; NVFP4 in all blocks: the run the doc's \"the bf16 "
    "tail costs about 5% throughput\" compares with); "
    "torchao `torchao/float8/README.md` (Llama-3 8B, 8 H100, FSDP2, torch.compile)")


def build(cfg: Config) -> torch.nn.Module:
    """The Llama of ``cfg`` on the meta device: no weights are made or read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                     num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                     intermediate_size=cfg.inter, vocab_size=cfg.vocab,
                     max_position_embeddings=max(cfg.seq, 64), rope_theta=500000.0,
                     use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(hf).eval()


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits  # (B, T, vocab)


def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over fp32 logits (torchtitan's ``cross_entropy_loss``)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def traced(cfg: Config) -> tuple[torch.nn.Module, object, object, float]:
    """(meta model, its LayerGraph, its loss's kernels, seconds): one sequence traced."""
    from autoprec.measure import record_loss
    from autoprec.trace.shape_only import shadowed, trace_shapes

    t0 = time.perf_counter()
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab, (1, cfg.seq), generator=torch.Generator().manual_seed(0))
    graph = trace_shapes(model, ids, forward=forward)
    with shadowed():
        kernels = record_loss(model, forward, loss, ids)
    return model, graph, kernels, time.perf_counter() - t0


def _ms(sec: float) -> str:
    """Milliseconds to three significant figures or more (no exponent)."""
    ms = sec * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def split(bd) -> tuple[float, float, float]:  # noqa: ANN001
    """(GEMMs, casts + quantisation, the rest) of a step's breakdown, seconds."""
    p = bd.parts
    gemm = p["fprop"] + p["dgrad"] + p["wgrad"]
    quant = p["casts"] + p["fp8_scaling"]
    return gemm, quant, bd.total_s - gemm - quant


def device_table(key: str, cfg: Config, model, graph, kernels, dev: str,  # noqa: ANN001
                 tuned: Path | None = None) -> tuple[list[str], dict[str, float]]:
    """The plans' rows on one device, and each plan's eager ratio to bf16 autocast."""
    prof = get_profile(dev)
    costs = {}
    for mode in ("eager", "compile"):
        c = make_cost_model(graph, prof, cfg.batch, mode, step=True, form="train")
        c.step.set_loss(c, kernels)
        costs[mode] = c
    plans: dict[str, tuple[str, Policy, str, int]] = {
        "fp32": ("fp32 (no autocast)", Policy(default="fp32", form="train"), "-", 0),
        "bf16": ("bf16 autocast (one global autocast)", Policy(default="bf16", form="train"),
                 "-", 0)}
    skipped: dict[str, list[str]] = {}  # why -> the recipes it rules out
    for rp in recipe_plans(model, graph):
        ok, why = prof.supports(rp.recipe.fmt)
        if not ok:
            skipped.setdefault(why, []).append(rp.recipe.name)
            continue
        plans[rp.recipe.key] = (rp.recipe.name, rp.policy, rp.recipe.source,
                                len(rp.policy.layers))
    if tuned is not None:
        pol = load_policy(tuned)
        bad = [why for f in sorted(set(pol.layers.values()) | {pol.default})
               for ok, why in [prof.supports(f)] if not ok]
        if bad:
            skipped.setdefault(bad[0], []).append(f"tuned plan ({tuned.name})")
        else:
            plans["tuned"] = (f"tuned plan (autoprec tune --form train: {tuned.name})", pol,
                              "measured sensitivity, priced step", len(pol.layers))
    seconds = {m: {k: c.estimate(p) for k, (_, p, _, _) in plans.items()}
               for m, c in costs.items()}
    measured = MEASURED.get((key, dev), {})
    rows, ratios = [], {}
    for k, (name, pol, source, n) in plans.items():
        bd = costs["eager"].breakdown(pol)
        gemm, quant, rest = split(bd)
        ratio = seconds["eager"]["bf16"] / seconds["eager"][k]
        ratios[k] = ratio
        got = measured.get(k)
        rows.append([name, n, _ms(bd.total_s), f"{ratio:.2f}x",
                     f"{seconds['compile']['bf16'] / seconds['compile'][k]:.2f}x",
                     f"{_ms(gemm)} ({gemm / bd.total_s:.0%})",
                     f"{_ms(quant)} ({quant / bd.total_s:.0%})",
                     f"{_ms(rest)} ({rest / bd.total_s:.0%})",
                     f"{got[0]:.2f}x ({got[1]})" if got else "", source])
    head = (f"\n### {key} on {dev} ({prof.name}): {cfg.batch} x {cfg.seq} tokens per GPU "
            "per step\n")
    lines = [head, markdown(("plan", "Linears converted", "step ms (eager)", "vs bf16 eager",
                             "vs bf16 compiled", "GEMM ms", "casts+quant ms", "other ms",
                             "measured vs bf16", "rule (source)"), rows)]
    for why, names in skipped.items():
        lines += ["", f"Not on {dev}: {', '.join(names)} ({why})."]
    lines += [f"\n{plans[k][0]}: {why}." for k, why in NOTES.items() if k in plans]
    tok = TOKENS_PER_S.get((key, dev))
    if tok:
        step = cfg.batch * cfg.seq  # tokens per GPU per step
        rows = [[plans[k][0], f"{step / t:.3f}", f"{seconds['compile'][k]:.3f}",
                 f"{step / t - seconds['compile'][k]:.3f}",
                 f"{seconds['compile'][k] * t / step:.0%}"] for k, t in tok.items()]
        lines += ["", f"Measured step against priced ({step} tokens per GPU per step; "
                  "compiled, as the runs were):", "",
                  markdown(("plan", "measured s", "priced s (compiled)", "measured - priced s",
                            "priced / measured"), rows)]
    return lines, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--toy", action="store_true",
                    help="a 4-block, 256-wide Llama at 4 x 64 tokens (a smoke run)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"write the tables here (default without --toy: "
                         f"{(RESULTS / 'recipes_priced.md').relative_to(ROOT)})")
    ap.add_argument("--tuned", action="append", default=[], metavar="MODEL=POLICY",
                    help="price this policy file as a row of MODEL's tables (repeatable)")
    args = ap.parse_args()
    tuned: dict[str, Path] = {}
    for item in args.tuned:
        name, _, path = item.partition("=")
        if not path or not Path(path).is_file():
            print(f"recipes_priced: --tuned {item!r}: expected MODEL=POLICY.yaml with an "
                  "existing file", file=sys.stderr)
            raise SystemExit(2)
        tuned[name] = Path(path)
    known = TOY if args.toy else MODELS
    unknown = [k for k in tuned if k not in known]
    if unknown:
        print(f"recipes_priced: --tuned {unknown[0]}=...: no such model; known: "
              f"{', '.join(known)}", file=sys.stderr)
        raise SystemExit(2)
    keys = list(known) if args.toy else choose(args.models, MODELS)
    out_path = args.out or (None if args.toy else RESULTS / "recipes_priced.md")
    cmd = "python -m benchmarks.recipes_priced" + (
        " --toy" if args.toy else f" --models {','.join(keys)}") + "".join(
        f" --tuned {k}={v}" for k, v in tuned.items())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    out = [f"# Fixed training recipes priced as training steps (command: `{cmd}`)", "",
           f"{date.today()}, commit {commit or 'unknown'}; traced shape-only on {cpu_name()}, "
           f"torch {torch.__version__}; priced on the stored device profiles (dense datasheet "
           "peaks, `autoprec/cost/devices.yaml`), fused AdamW. Ratios are bf16 autocast's step "
           "time over the plan's (higher is faster). GEMM = fprop + dgrad + wgrad (the Linears' "
           "GEMMs and fused attention); casts+quant = autocast's casts and the formats' "
           "scaling passes; other = norms, activations, RoPE, residual adds, the loss over "
           "the fp32 logits, the optimizer.", "",
           f"Measured: {SOURCES}.", ""]
    print("\n".join(out), flush=True)
    for key in keys:
        cfg = known[key]
        model, graph, kernels, secs = traced(cfg)
        new = [f"\n## {key}: hidden {cfg.hidden}, {cfg.layers} blocks, FFN {cfg.inter}, heads "
               f"{cfg.heads}/{cfg.kv_heads}, vocabulary {cfg.vocab} (traced in {secs:.0f} s)"]
        for dev in DEVICES:
            new += device_table(key, cfg, model, graph, kernels, dev, tuned.get(key))[0]
        out += new
        print("\n".join(new), flush=True)
    if out_path is not None:
        out_path.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
