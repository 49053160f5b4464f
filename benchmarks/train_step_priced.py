"""A training step priced on the H100 and B200 profiles: GPT-2 (124 M) and a 1 B Llama.

Each model is built from its transformers config with random init (no weights are fetched),
its forward recorded once on this CPU (fp32, batch 1), and the whole training step —
forward, backward, fused AdamW — priced by ``CostModel(..., step=StepPart())`` (``autoprec.cost.step``) at a
training micro-batch for these plans:

- ``fp32``: no autocast (what ``Trainer`` runs without ``bf16=True``);
- ``bf16 autocast``: one global bf16 autocast (``TrainingArguments(bf16=True)``);
- ``fp8 everywhere (TE)``: ``default: bf16`` and every fp8-eligible Linear in fp8, fprop,
  dgrad and wgrad in fp8 as Transformer Engine / torchao's Float8Linear run them;
- ``fp8 first/last bf16 (TE)``: the same with the first and last blocks and the LM head in
  bf16 (Megatron / TE's ``first_last_layers_bf16``);
- ``fp8, dequantised fp32 backward``: fp8 everywhere with the backward the ``emulated``
  backend runs (dY, W, X dequantised, fp32 GEMMs) — what autoprec's ``torch`` backend ran
  before its backward moved to ``_scaled_mm`` (the issue's "fp8 training is not fp8");
- ``tuned plan (tune --form train)`` (``--tune``): ``autoprec.tune(form="train")`` run on
  each device for a 3-block copy of GPT-2 / the Llama, its decisions mapped onto the full
  model by block role (``train_step_tuned``), with the layers it kept above fp8 and why.

Printed: step ms, speed-up over fp32 and over bf16, where the time goes (fprop / dgrad /
wgrad / casts / fp8 scaling / other / optimizer) and the training memory. Anchors beside
them: Transformer Engine's fp8 delayed-scaling GEMM speed-up over bf16, 1.69x on H200 (5 B
config, quantisation included); torchao float8 training 1.25x end to end (Llama-3 8B,
8 GPUs).

    .venv/bin/python -m benchmarks.train_step_priced [--models gpt2,llama] [--tune] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date
from pathlib import Path

import torch

from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import STEP_PARTS, StepPart
from autoprec.policy import Policy
from autoprec.trace import trace
from benchmarks.common import RESULTS, ROOT

DEVICES = ("h100", "b200")
TUNE_NOTE = (
    "The tuned plan: `autoprec.tune(model, form=\"train\", target=h100|b200, max_error=0.05, "
    "precisions=fp32,tf32,bf16,fp16,fp8, trials=10)` run for real on a **3-block copy** of "
    "each config (same widths, heads and vocabulary; the first, one inner and the last "
    "block), on real text (stdlib docstrings as byte tokens, 2 x 2 x 128 calibration and "
    "eval tokens), priced by tune at the table's tokens per step (batch 64 x 128 for GPT-2, "
    "32 x 128 for Llama). Its per-layer decisions were found on that copy and mapped onto "
    "the full model by role: block 0 to block 0, the inner block to every inner block, the "
    "last to the last, layers outside the blocks by path (`benchmarks/train_step_tuned.py`). "
    "A full-depth tune on this 2-core CPU would take tens of minutes per model and device.")
ANCHORS = ("TE fp8 delayed scaling, GEMMs incl. quantisation, over bf16: 1.69x (H200, 5 B "
           "config); torchao float8 training end to end: 1.25x (Llama-3 8B, 8 GPUs)")


def gpt2_of(blocks: int = 12) -> torch.nn.Module:
    """GPT-2 small's config (width 768, 12 heads, 1024 positions) with ``blocks`` blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_layer=blocks, n_head=12, n_positions=1024, use_cache=False)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def llama_of(blocks: int = 22) -> torch.nn.Module:
    """TinyLlama's config (hidden 2048, 32 heads, 4 KV heads, FFN 5632, vocabulary 32000)
    with ``blocks`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=blocks, num_attention_heads=32,
                      num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                      max_position_embeddings=2048, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def gpt2() -> tuple[torch.nn.Module, torch.Tensor, int, str]:
    """GPT-2 small (124 M): width 768, 12 blocks, 12 heads, 1024 tokens; micro-batch 8."""
    return (gpt2_of(12), torch.randint(0, 50257, (1, 1024)), 8,
            "GPT-2 124M (768 wide, 12 blocks), 8 x 1024 tokens")


def llama() -> tuple[torch.nn.Module, torch.Tensor, int, str]:
    """A 1.1 B Llama (TinyLlama's shape, 22 layers), 512 tokens per sequence; micro-batch 8."""
    return (llama_of(22), torch.randint(0, 32000, (1, 512)), 8,
            "Llama 1.1B (2048 wide, 22 layers, GQA 32/4), 8 x 512 tokens")


def issue() -> tuple[torch.nn.Module, torch.Tensor, int, str]:
    """Issue 46's repro: GPT-2 width 768, 2 blocks, vocabulary 50257, 64 x 128 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_layer=2, n_head=12, n_positions=128, use_cache=False)
    torch.manual_seed(0)
    return (GPT2LMHeadModel(cfg).eval(), torch.randint(0, cfg.vocab_size, (1, 128)), 64,
            "GPT-2 768 wide, 2 blocks (issue 46's repro), 64 x 128 tokens")


MODELS = {"gpt2": gpt2, "llama": llama, "issue": issue}
#: the models tuned with --tune: (builder by block count, full block count, tokens per step)
TUNABLE = {"gpt2": (gpt2_of, 12, 8 * 1024), "llama": (llama_of, 22, 8 * 512)}
TUNED = "tuned plan (tune --form train)"


def fp8_leaves(graph) -> list[str]:  # noqa: ANN001
    """The GEMM leaves that may run fp8 (16-aligned Linear-like layers)."""
    return [n.path for n in graph if n.is_leaf and "fp8" in n.allowed]


def _block_of(path: str) -> int | None:
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("h", "layers") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def plans(graph, tuned: Policy | None = None) -> dict[str, tuple[Policy, str]]:  # noqa: ANN001
    """The plans priced, with the fp8 backward each runs ("fp8": TE / torchao); ``tuned``:
    the device's tuned plan, priced after the one-liners."""
    fp8 = fp8_leaves(graph)
    blocks = [b for b in (_block_of(p) for p in fp8) if b is not None]
    first, last = min(blocks), max(blocks)
    inner = [p for p in fp8 if _block_of(p) not in (None, first, last)]
    out = {
        "fp32": (Policy(default="fp32"), "fp8"),
        "bf16 autocast": (Policy(default="bf16"), "fp8"),
        "fp8 everywhere (TE)": (Policy(default="bf16", layers=dict.fromkeys(fp8, "fp8")), "fp8"),
        "fp8 first/last bf16 (TE)": (Policy(default="bf16", layers=dict.fromkeys(inner, "fp8")),
                                     "fp8"),
        "fp8, dequantised fp32 backward": (
            Policy(default="bf16", layers=dict.fromkeys(fp8, "fp8")), "fp32"),
    }
    if tuned is not None:
        out[TUNED] = (tuned, "fp8")
    return out


def _gemm_s(bd) -> float:  # noqa: ANN001
    """The step's GEMMs with what feeds them — autocast's casts, fp8's quantisation — (what
    TE's 1.69x over bf16 compares: its Linear layers' GEMMs, quantisation included)."""
    return sum(bd.parts[k] for k in ("fprop", "dgrad", "wgrad", "casts", "fp8_scaling"))


def table(name: str, graph, batch: int,  # noqa: ANN001
          tuned: dict[str, Policy] | None = None) -> list[str]:
    """The plans' rows on each device; ``tuned``: device -> its tuned plan (full model)."""
    lines = []
    cols = ("fprop", "dgrad", "wgrad", "casts", "fp8_scaling", "other", "optimizer")
    for dev in DEVICES:
        prof = get_profile(dev)
        models = {s: CostModel(graph, prof, batch, step=StepPart(fp8_backward=s)) for s in ("fp8", "fp32")}
        lines += [f"\n### {name} on {dev}\n",
                  "| plan | step ms | vs fp32 | vs bf16 | GEMMs+casts vs bf16 | fwd only vs fp32 | "
                  "fwd ms | bwd ms | "
                  + " | ".join(f"{c} ms" for c in cols) + " | memory GB |",
                  "|---" * (9 + len(cols)) + "|"]
        bds = {}
        for label, (pol, style) in plans(graph, (tuned or {}).get(dev)).items():
            bds[label] = models[style].breakdown(pol)
        f32, b16 = bds["fp32"].total_s, bds["bf16 autocast"].total_s
        g16 = _gemm_s(bds["bf16 autocast"])
        for label, bd in bds.items():
            mem = bd.memory.peak_bytes / 1e9 if bd.memory else float("nan")
            fwd = bds["fp32"].forward_s / bd.forward_s
            lines.append(f"| {label} | {bd.total_s * 1e3:.2f} | {f32 / bd.total_s:.2f}x | "
                         f"{b16 / bd.total_s:.2f}x | {g16 / _gemm_s(bd):.2f}x | {fwd:.2f}x | "
                         f"{bd.forward_s * 1e3:.2f} | "
                         f"{bd.backward_s * 1e3:.2f} | "
                         + " | ".join(f"{bd.parts[c] * 1e3:.2f}" for c in cols)
                         + f" | {mem:.2f} |")
        assert set(cols) <= set(STEP_PARTS)
    return lines


def tuned_plans(key: str, policies: Path) -> tuple[dict[str, Policy], list[str]]:
    """Tune ``key``'s reduced-depth config on each device (``train_step_tuned``); the plans
    mapped to the full model, and the lines that say what each kept high and why."""
    from benchmarks.train_step_tuned import REDUCED_BLOCKS, SEQ, run_tune

    build, full_blocks, tokens = TUNABLE[key]
    plans_, lines = {}, []
    for dev in DEVICES:
        out = policies / f"{key}-{REDUCED_BLOCKS}blocks-{dev}.yaml"
        t = run_tune(build, full_blocks, dev, tokens // SEQ, out, f"{key}-{REDUCED_BLOCKS}blocks")
        plans_[dev] = t.full
        bf16 = "?" if t.bf16_est is None else f"{t.bf16_est:.2f}x"
        lines += [f"\n#### Tuned on {dev}: {key}, {REDUCED_BLOCKS} of {full_blocks} blocks "
                  f"({t.seconds:.0f} s), written to `{out.relative_to(ROOT)}`\n",
                  f"tune's own estimate on the reduced model: {t.est_speedup:.2f}x over fp32 "
                  f"(bf16 autocast {bf16}), eval error {t.error:.4g}; plan `default: "
                  f"{t.policy.default}`, rules {dict(t.policy.layers) or 'none'}; mapped to "
                  f"{len(t.full.layers)} rules on the full model.", "",
                  "```", t.table, "```", "",
                  f"fp8-eligible layers kept above fp8 ({len(t.kept)}):", ""]
        lines += [f"- `{k.path}`: {k.precision} — {k.why}" for k in t.kept] or ["- none"]
    return plans_, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here")
    ap.add_argument("--tune", action="store_true",
                    help="add the tuned plan's rows: tune a 3-block copy of gpt2 / llama on "
                         "each device (minutes per model and device on a CPU)")
    ap.add_argument("--policies", type=Path, default=RESULTS / "train_step_tuned",
                    help="where --tune writes the tuned policies")
    args = ap.parse_args()
    cmd = f"--models {args.models}" + (" --tune" if args.tune else "")
    out = [f"# Training step priced (command: `python -m benchmarks.train_step_priced {cmd}`)",
           "", f"{date.today()}, commit {_commit()}. "
           f"Traced on {platform.processor() or platform.machine()} ({_cpu()}), torch "
           f"{torch.__version__}; priced on the stored device profiles (datasheet peaks), "
           "fused AdamW.", "",
           f"Anchors: {ANCHORS}."]
    if args.tune:
        out += ["", TUNE_NOTE]
    print("\n".join(out), flush=True)
    for key in args.models.split(","):
        tuned, tune_lines = (tuned_plans(key, args.policies) if args.tune and key in TUNABLE
                             else (None, []))
        model, ids, batch, name = MODELS[key]()
        t0 = time.perf_counter()
        graph = trace(model, ids, tracers=("hooks",),
                      forward=lambda m, b: m(input_ids=b).logits)
        del model
        out.append(f"\n{name}: traced in {time.perf_counter() - t0:.0f} s; "
                   f"{len(fp8_leaves(graph))} fp8-eligible GEMM leaves")
        new = [out[-1], *table(name, graph, batch, tuned), *tune_lines]
        out += new[1:]
        print("\n".join(new), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(out) + "\n")


def _commit() -> str:
    import subprocess

    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() or "unknown"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path(
            "/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
