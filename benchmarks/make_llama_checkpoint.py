"""A random-weight Llama checkpoint folder, written shard by shard (never the model whole).

The folder is what ``save_pretrained`` writes for a ``LlamaForCausalLM``: ``config.json``
(transformers' ``LlamaConfig``, ``dtype`` bfloat16), safetensors shards named
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``weight_map``:
tensor name -> shard), tensors named as HF's Llama names them (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``; no ``lm_head`` when the
embeddings are tied). The names and shapes come from the model built on ``meta`` (no
memory); each tensor is drawn from its own generator (seeded by ``--seed`` and its name,
so the weights do not depend on the shard size): linear and embedding weights
N(0, ``initializer_range``) as HF's ``_init_weights`` draws them, norms ones. One shard is
held at a time (``--shard-gb``, default 2 GB); ``config.json`` is written last, so a folder
left by an interrupted run is not a checkpoint (``autoprec`` refuses it in one line).

Presets (public shapes, random weights, nothing downloaded):

- ``tiny``: hidden 64, 2 layers, vocabulary 256 (the tests' size);
- ``1.1b``: TinyLlama-1.1B — hidden 2048, intermediate 5632, 22 layers, 32 heads / 4 KV
  heads, vocabulary 32000, untied head;
- ``3b``: Llama-3.2-3B (3.21 B parameters) — hidden 3072, intermediate 8192, 28 layers, 24 heads / 8 KV heads,
  vocabulary 128256, tied embeddings;
- ``8b``: Llama-3.1-8B — hidden 4096, intermediate 14336, 32 layers, 32 heads / 8 KV heads,
  vocabulary 128256, untied head (16 GB in bf16).

    python -m benchmarks.make_llama_checkpoint --preset 1.1b --out /work/ckpt/llama-1.1b
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: preset -> LlamaConfig arguments (``dtype`` bfloat16 for all).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=256, tie_word_embeddings=False),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False),
    # Llama-3.1-70B's shapes: sized (``--sizes``, ``benchmarks.stream_memory``), too large
    # to write on the team's 60 GB disks
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False),
}
DTYPE = torch.bfloat16
INDEX = "model.safetensors.index.json"


def config_of(preset: str) -> Any:
    """The preset's ``LlamaConfig`` (bf16, no KV cache)."""
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise SystemExit(f"make_llama_checkpoint: unknown preset {preset!r}; known: "
                         f"{', '.join(PRESETS)}")
    cfg = LlamaConfig(**PRESETS[preset], use_cache=False)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = DTYPE  # config.json: "dtype": "bfloat16" (what Checkpoint.dtype reads)
    return cfg


def tensor_specs(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, in the model's order, from the model built on
    ``meta`` (tied weights once, under the first name)."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        model.tie_weights()  # lm_head is embed_tokens: stored once
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def plan_shards(specs: list[tuple[str, tuple[int, ...]]], shard_bytes: int
                ) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors in order, cut into shards of at most ``shard_bytes`` (a tensor larger
    than that is a shard of its own), as ``save_pretrained`` cuts them."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        n = _nbytes(shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def _nbytes(shape: tuple[int, ...]) -> int:
    n = DTYPE.itemsize
    for d in shape:
        n *= d
    return n


def random_tensor(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """One tensor as HF initialises it: ones for a norm's weight (1-D), else N(0, std); its
    own generator, seeded from ``seed`` and the name."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=DTYPE)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    out = torch.empty(shape, dtype=DTYPE)
    rows = max(1, (64 << 20) // (4 * shape[-1]))  # fp32 draws in 64 MB slabs
    flat = out.view(-1, shape[-1])  # (rows, cols)
    for i in range(0, flat.shape[0], rows):
        part = flat[i:i + rows]
        part.copy_(torch.randn(part.shape, generator=g).mul_(std))
    return out


def write(preset: str, out: Path, *, seed: int = 0, shard_gb: float = 2.0,
          log: Any = None) -> Path:
    """Write the preset's checkpoint into ``out`` (module doc); returns ``out``."""
    from safetensors.torch import save_file

    cfg = config_of(preset)
    out.mkdir(parents=True, exist_ok=True)
    size = parameters(preset) * DTYPE.itemsize
    free = shutil.disk_usage(out).free
    if free < size * 1.02:
        raise SystemExit(f"make_llama_checkpoint: {out}: {preset} needs {size / 1e9:.1f} GB, "
                         f"the disk has {free / 1e9:.1f} GB free")
    if (out / "config.json").exists():
        (out / "config.json").unlink()  # the folder is a checkpoint again once complete
    shards = plan_shards(tensor_specs(cfg), int(shard_gb * 1e9))
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        t0 = time.monotonic()
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(n, s, cfg.initializer_range, seed) for n, s in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        total += size
        weight_map.update((n, fname) for n, _ in shard)
        if log is not None:
            print(f"{fname}: {len(shard)} tensors, {size / 1e9:.2f} GB, "
                  f"{time.monotonic() - t0:.1f} s", file=log, flush=True)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2) + "\n")
    cfg.save_pretrained(str(out))  # config.json last: the folder is complete
    return out


def parameters(preset: str) -> int:
    """The preset's parameter count (tied weights once)."""
    return sum(_nbytes(s) for _, s in tensor_specs(config_of(preset))) // DTYPE.itemsize


def _iter_sizes() -> Iterator[str]:
    for p in PRESETS:
        n = parameters(p)
        yield f"{p}: {n / 1e9:.2f} B parameters, {n * DTYPE.itemsize / 1e9:.2f} GB in bf16"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), help="the model's shapes")
    ap.add_argument("--out", type=Path, help="the checkpoint folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=2.0, help="largest shard (GB)")
    ap.add_argument("--sizes", action="store_true", help="print each preset's size and exit")
    args = ap.parse_args(argv)
    if args.sizes:
        print("\n".join(_iter_sizes()))
        return
    if args.preset is None or args.out is None:
        ap.error("--preset and --out are required")
    t0 = time.monotonic()
    write(args.preset, args.out, seed=args.seed, shard_gb=args.shard_gb, log=sys.stdout)
    print(f"{args.out}: {args.preset}, {parameters(args.preset) / 1e9:.2f} B parameters, "
          f"{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
