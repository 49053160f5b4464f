"""What a streamed tune of a Llama holds, from its shapes alone: 1.1 B to 70 B.

For each preset of ``benchmarks/make_llama_checkpoint.py`` (TinyLlama-1.1B, Llama-3.2-3B,
Llama-3.1-8B and Llama-3.1-70B shapes, bf16) the model is built on ``meta`` and sized:
its weights, the resident parts (embeddings, final norm, LM head), its largest block, and
what ``autoprec tune`` budgets for it (``autoprec.tuning.memory``):

- **in memory**: the model twice (what a tune of a model.py needs: the model and a plan's
  copy);
- **streamed**: ``streamed_bytes`` — the resident parts, the largest block with a plan's
  copy of it, a plan's copy of the largest resident module (both up to fp32: the fp32 row of
  a bf16 model stores them in fp32) and the activations of the calibration (1 x 64 tokens, the folder's default) or of a larger batch
  (``--tokens``), in the deploy form (weights as stored, bf16) and the training form
  (fp32 masters: every weight held in fp32).

These are the tune's own budget formulas, not measurements; ``benchmarks/tune_streamed.py``
measures the peak of real streamed tunes (the 1.1 B and 8 B rows of
``benchmarks/results/tune_streamed.md``) to set beside them.

    python -m benchmarks.stream_memory --write
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from benchmarks.common import RESULTS
from benchmarks.make_llama_checkpoint import DTYPE, PRESETS, config_of, tensor_specs
from benchmarks.tables import markdown

OUT = RESULTS / "stream_memory.md"
GPU_GB, HOST_GB = 80.0, 24.0  # one H100 / A100 80 GB; this team's machines


def _elems(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def sizes(preset: str, tokens: list[int]) -> dict[str, Any]:
    """The preset's bytes (module doc), per form and token count."""
    from autoprec.tuning.memory import streamed_bytes

    cfg = config_of(preset)
    specs = tensor_specs(cfg)
    blocks: dict[str, int] = {}
    units: dict[str, int] = {}  # resident module -> elements
    for name, shape in specs:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            blocks[parts[2]] = blocks.get(parts[2], 0) + _elems(shape)
        else:
            unit = name.rpartition(".")[0]
            units[unit] = units.get(unit, 0) + _elems(shape)
    block, resident, unit = max(blocks.values()), sum(units.values()), max(units.values())
    total = resident + sum(blocks.values())
    row: dict[str, Any] = {"preset": preset, "params": total, "blocks": len(blocks)}
    for form, size in (("deploy", DTYPE.itemsize), ("train", 4)):
        row[f"{form}_weights"] = total * size
        row[f"{form}_in_memory"] = 2 * total * size
        for t in tokens:
            need, act = streamed_bytes(resident * size, block * size, cfg.vocab_size,
                                       cfg.hidden_size, t, unit * size, 4 / size)
            row[f"{form}_streamed_{t}"] = need
    row["resident"], row["block"] = resident * DTYPE.itemsize, block * DTYPE.itemsize
    return row


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def _fits(n: float, gb: float) -> str:
    return "yes" if n <= gb * 1e9 else "no"


def table(rows: list[dict[str, Any]], tokens: list[int]) -> str:
    head = ["model", "params", "blocks", "weights GB (bf16)", "resident GB", "block GB",
            "in memory GB (2x)"]
    head += [f"streamed GB, {t} tokens" for t in tokens]
    head += ["train: streamed GB (fp32 masters)", f"deploy fits {HOST_GB:.0f} GB host",
             f"deploy / train fit one {GPU_GB:.0f} GB GPU"]
    body = []
    for r in rows:
        big = tokens[-1]
        body.append([r["preset"], f"{r['params'] / 1e9:.2f} B", r["blocks"],
                     _gb(r["deploy_weights"]), _gb(r["resident"]), _gb(r["block"]),
                     _gb(r["deploy_in_memory"]),
                     *[_gb(r[f"deploy_streamed_{t}"]) for t in tokens],
                     _gb(r[f"train_streamed_{big}"]),
                     _fits(r[f"deploy_streamed_{tokens[0]}"], HOST_GB),
                     f"{_fits(r[f'deploy_streamed_{big}'], GPU_GB)} / "
                     f"{_fits(r[f'train_streamed_{big}'], GPU_GB)}"])
    return markdown(head, body)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,2048",
                    help="token counts to size the activations for (comma-separated)")
    ap.add_argument("--presets", default=",".join(p for p in PRESETS if p != "tiny"))
    ap.add_argument("--write", action="store_true", help=f"write {OUT.name}")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [sizes(p.strip(), tokens) for p in args.presets.split(",")]
    text = table(rows, tokens)
    print(text)
    if args.write:
        OUT.write_text(
            "# stream_memory: what a streamed tune of a Llama budgets, from its shapes\n\n"
            f"`python -m benchmarks.stream_memory {' '.join(argv or [])}`".rstrip() + " — "
            f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d} (shapes only: no weights, no "
            "machine; the formulas of `autoprec.tuning.memory`)\n\n" + text + "\n")


if __name__ == "__main__":
    main()
