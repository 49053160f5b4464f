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
  bf16 (Megatron / TE's ``first_last_layers_bf16``) — priced in place of a tuned plan (a full
  tune of a 124 M model on this 2-core machine takes longer than this script may run);
- ``fp8, dequantised fp32 backward``: fp8 everywhere with the backward the ``emulated``
  backend runs (dY, W, X dequantised, fp32 GEMMs) — what autoprec's ``torch`` backend ran
  before its backward moved to ``_scaled_mm`` (the issue's "fp8 training is not fp8").

Printed: step ms, speed-up over fp32 and over bf16, where the time goes (fprop / dgrad /
wgrad / casts / fp8 scaling / other / optimizer) and the training memory. Anchors beside
them: Transformer Engine's fp8 delayed-scaling GEMM speed-up over bf16, 1.69x on H200 (5 B
config, quantisation included); torchao float8 training 1.25x end to end (Llama-3 8B,
8 GPUs).

    .venv/bin/python benchmarks/train_step_priced.py [--models gpt2,llama] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import STEP_PARTS, StepPart
from autoprec.policy import Policy
from autoprec.trace import trace

DEVICES = ("h100", "b200")
ANCHORS = ("TE fp8 delayed scaling, GEMMs incl. quantisation, over bf16: 1.69x (H200, 5 B "
           "config); torchao float8 training end to end: 1.25x (Llama-3 8B, 8 GPUs)")


def gpt2() -> tuple[torch.nn.Module, torch.Tensor, int, str]:
    """GPT-2 small (124 M): width 768, 12 blocks, 12 heads, 1024 tokens; micro-batch 8."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, use_cache=False)
    torch.manual_seed(0)
    return (GPT2LMHeadModel(cfg).eval(), torch.randint(0, cfg.vocab_size, (1, 1024)), 8,
            "GPT-2 124M (768 wide, 12 blocks), 8 x 1024 tokens")


def llama() -> tuple[torch.nn.Module, torch.Tensor, int, str]:
    """A 1.1 B Llama (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads, FFN
    5632, vocabulary 32000), 512 tokens per sequence; micro-batch 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                      max_position_embeddings=2048, use_cache=False)
    torch.manual_seed(0)
    return (LlamaForCausalLM(cfg).eval(), torch.randint(0, 32000, (1, 512)), 8,
            "Llama 1.1B (2048 wide, 22 layers, GQA 32/4), 8 x 512 tokens")


def issue() -> tuple[torch.nn.Module, torch.Tensor, int, str]:
    """Issue 46's repro: GPT-2 width 768, 2 blocks, vocabulary 50257, 64 x 128 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_layer=2, n_head=12, n_positions=128, use_cache=False)
    torch.manual_seed(0)
    return (GPT2LMHeadModel(cfg).eval(), torch.randint(0, cfg.vocab_size, (1, 128)), 64,
            "GPT-2 768 wide, 2 blocks (issue 46's repro), 64 x 128 tokens")


MODELS = {"gpt2": gpt2, "llama": llama, "issue": issue}


def fp8_leaves(graph) -> list[str]:  # noqa: ANN001
    """The GEMM leaves that may run fp8 (16-aligned Linear-like layers)."""
    return [n.path for n in graph if n.is_leaf and "fp8" in n.allowed]


def _block_of(path: str) -> int | None:
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("h", "layers") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def plans(graph) -> dict[str, tuple[Policy, str]]:  # noqa: ANN001
    """The plans priced, with the fp8 backward each runs ("fp8": TE / torchao)."""
    fp8 = fp8_leaves(graph)
    blocks = [b for b in (_block_of(p) for p in fp8) if b is not None]
    first, last = min(blocks), max(blocks)
    inner = [p for p in fp8 if _block_of(p) not in (None, first, last)]
    return {
        "fp32": (Policy(default="fp32"), "fp8"),
        "bf16 autocast": (Policy(default="bf16"), "fp8"),
        "fp8 everywhere (TE)": (Policy(default="bf16", layers=dict.fromkeys(fp8, "fp8")), "fp8"),
        "fp8 first/last bf16 (TE)": (Policy(default="bf16", layers=dict.fromkeys(inner, "fp8")),
                                     "fp8"),
        "fp8, dequantised fp32 backward": (
            Policy(default="bf16", layers=dict.fromkeys(fp8, "fp8")), "fp32"),
    }


def _gemm_s(bd) -> float:  # noqa: ANN001
    """The step's GEMMs with what feeds them — autocast's casts, fp8's quantisation — (what
    TE's 1.69x over bf16 compares: its Linear layers' GEMMs, quantisation included)."""
    return sum(bd.parts[k] for k in ("fprop", "dgrad", "wgrad", "casts", "fp8_scaling"))


def table(name: str, graph, batch: int) -> list[str]:  # noqa: ANN001
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
        for label, (pol, style) in plans(graph).items():
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = ap.parse_args()
    out = [f"# Training step priced (command: `python benchmarks/train_step_priced.py "
           f"--models {args.models}`)", "",
           f"Traced on {platform.processor() or platform.machine()}, torch {torch.__version__};"
           " priced on the stored device profiles (datasheet peaks), fused AdamW.", "",
           f"Anchors: {ANCHORS}."]
    print("\n".join(out), flush=True)
    for key in args.models.split(","):
        model, ids, batch, name = MODELS[key]()
        t0 = time.perf_counter()
        graph = trace(model, ids, tracers=("hooks",),
                      forward=lambda m, b: m(input_ids=b).logits)
        del model
        out.append(f"\n{name}: traced in {time.perf_counter() - t0:.0f} s; "
                   f"{len(fp8_leaves(graph))} fp8-eligible GEMM leaves")
        new = [out[-1], *table(name, graph, batch)]
        out += new[1:]
        print("\n".join(new), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
