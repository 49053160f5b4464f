"""Per-layer error of per-tensor fp8 vs MXFP8 vs NVFP4 (emulated).

For every Linear layer of (a) ``examples/wide`` (2048-wide MLP, random init, inputs
with outlier channels) and (b) real all-MiniLM-L6-v2 (``examples/minilm``), over the
calibration data:

- local error: relative L2 error of the layer's output when it alone computes in the
  format — input and weight quantised (fp8: per-tensor e4m3 current scaling,
  ``autoprec.formats.fp8.fake_quant_fp8``; mxfp8: E4M3 + E8M0 per 32 along K, the OCP spec's
  floor scale, and ``mxfp8r`` the same with NVIDIA's rceil scale; nvfp4: E2M1 + E4M3 per
  16 along K + per-tensor fp32), fp32 accumulate, on the layer's fp32 input;
- e2e error: relative L2 error of the model's outputs (docs/overview.md's default error) with
  that layer alone lowered, the rest fp32;
- outliers: max over input columns of the column's max|x|, divided by the median column
  max; a layer is marked an outlier layer when that ratio is >= 10.

Writes ``benchmarks/results/blockscale_error.md`` and prints it. About a minute on 2 cores.
Run: ``PYTHONPATH=. .venv/bin/python -m benchmarks.blockscale_error``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.formats import fake_quant_fp8, fake_quant_mxfp8, fake_quant_nvfp4
from autoprec.formats.gemm import ineligible_reason
from autoprec.workload.loading import ModelSpec, load_model_file
from autoprec.workload.metrics import ErrorAccumulator, detach_floats
from benchmarks.common import RESULTS, example

OUT = RESULTS / "blockscale_error.md"
FORMATS = ("fp8", "mxfp8", "mxfp8r", "nvfp4")
E2E_FORMATS = ("fp8", "mxfp8", "nvfp4")
OUTLIER_RATIO = 10.0

Quant = Callable[[torch.Tensor], torch.Tensor]

#: Each format's fake quantiser along the last dim; a GEMM reads Q(x) @ Q(W)^T (+ b),
#: fp32 accumulate — what ``reference_fp8_linear`` / ``reference_blockscaled_linear``
#: compute, with Q(W) computed once per layer here.
QUANT: dict[str, Quant] = {
    "fp8": fake_quant_fp8,
    "mxfp8": fake_quant_mxfp8,
    "mxfp8r": lambda t: fake_quant_mxfp8(t, "rceil"),
    "nvfp4": fake_quant_nvfp4,
}


def _gemm(fmt: str, x: torch.Tensor, wq: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    x2 = x.float().reshape(-1, x.shape[-1])  # (tokens, K): per-tensor fp8 scales over these
    y = torch.nn.functional.linear(QUANT[fmt](x2), wq, b)
    return y.reshape(*x.shape[:-1], -1)


def _why_not(module: nn.Linear, fmt: str) -> str | None:
    if fmt == "fp8":
        return ineligible_reason(module, "fp8")
    return ineligible_reason(module, "mxfp8" if fmt == "mxfp8r" else fmt)


def _run(spec: ModelSpec, model: nn.Module, batches: list[Any]) -> list[list[torch.Tensor]]:
    with torch.no_grad():
        return [detach_floats(spec.forward(model, b)) for b in batches]


def _e2e(spec: ModelSpec, model: nn.Module, batches: list[Any],
         ref: list[list[torch.Tensor]]) -> float:
    acc = ErrorAccumulator()
    with torch.no_grad():
        for b, r in zip(batches, ref):
            acc.add(spec.forward(model, b), r)
    return acc.error


def _lowered(module: nn.Linear, fmt: str, wq: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _gemm(fmt, x, wq, module.bias).to(x.dtype)
    return forward


def measure(path: Path) -> tuple[str, list[dict[str, Any]], dict[str, float]]:
    """Rows (one per Linear) and whole-model e2e errors (every eligible Linear lowered)."""
    spec = load_model_file(path)
    model = spec.model()
    batches = list(spec.calibration_data())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    hooks = [m.register_forward_pre_hook(
        lambda _m, args, n=n: inputs[n].append(args[0].detach().float()))
        for n, m in linears.items()]
    ref = _run(spec, model, batches)
    for h in hooks:
        h.remove()

    wq: dict[tuple[str, str], torch.Tensor] = {}  # (layer, fmt) -> Q(W), computed once
    with torch.no_grad():
        for name, lin in linears.items():
            for fmt in FORMATS:
                if not _why_not(lin, fmt):
                    wq[name, fmt] = QUANT[fmt](lin.weight.float())

    rows = []
    for name, lin in linears.items():
        xs = [x.reshape(-1, x.shape[-1]) for x in inputs[name]]  # (tokens, K) per batch
        col = torch.cat(xs).abs().amax(0)  # (K,) max|x| per input column
        ratio = float(col.max() / col.median().clamp(min=1e-30))
        row: dict[str, Any] = {"layer": name, "k": lin.in_features, "n": lin.out_features,
                               "ratio": ratio}
        with torch.no_grad():
            y_ref = [torch.nn.functional.linear(x, lin.weight, lin.bias) for x in xs]
            for fmt in FORMATS:
                if _why_not(lin, fmt):
                    row[fmt] = row[f"e2e_{fmt}"] = None
                    continue
                acc = ErrorAccumulator()
                for x, y in zip(xs, y_ref):
                    acc.add(_gemm(fmt, x, wq[name, fmt], lin.bias), [y])
                row[fmt] = acc.error
        for fmt in E2E_FORMATS:
            if row[fmt] is None:
                continue
            lin.forward = _lowered(lin, fmt, wq[name, fmt])  # this layer alone lowered
            try:
                row[f"e2e_{fmt}"] = _e2e(spec, model, batches, ref)
            finally:
                del lin.forward  # back to the class's forward
        rows.append(row)

    whole = {}
    for fmt in E2E_FORMATS:
        lowered = [(n, lin) for n, lin in linears.items() if not _why_not(lin, fmt)]
        for n, lin in lowered:
            lin.forward = _lowered(lin, fmt, wq[n, fmt])
        try:
            whole[fmt] = _e2e(spec, model, batches, ref)
        finally:
            for _, lin in lowered:
                del lin.forward
    return spec.name, rows, whole


def _pct(v: float | None) -> str:
    if v is None:
        return "—"
    if not math.isfinite(v):
        return "inf"
    return f"{100 * v:.2f}%" if v >= 1e-3 else f"{100 * v:.3f}%"


def table(name: str, rows: list[dict[str, Any]], whole: dict[str, float]) -> list[str]:
    lines = [f"### {name}", "",
             "| layer | K→N | outlier ratio | fp8 | mxfp8 | mxfp8r | nvfp4 | e2e fp8 | "
             "e2e mxfp8 | e2e nvfp4 | mxfp8 < fp8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **(outlier)**" if r["ratio"] >= OUTLIER_RATIO else ""
        beats = "—" if r["mxfp8"] is None else ("yes" if r["mxfp8"] < r["fp8"] else "no")
        lines.append(
            f"| {r['layer']} | {r['k']}→{r['n']} | {r['ratio']:.1f}{mark} | {_pct(r['fp8'])} | "
            f"{_pct(r['mxfp8'])} | {_pct(r['mxfp8r'])} | {_pct(r['nvfp4'])} | "
            f"{_pct(r['e2e_fp8'])} | {_pct(r['e2e_mxfp8'])} | {_pct(r['e2e_nvfp4'])} | {beats} |")
    lines.append(f"| *all eligible layers* | | | | | | | {_pct(whole['fp8'])} | "
                 f"{_pct(whole['mxfp8'])} | {_pct(whole['nvfp4'])} | |")
    lines.append("")
    for group, pick in (("outlier", lambda r: r["ratio"] >= OUTLIER_RATIO),
                        ("other", lambda r: r["ratio"] < OUTLIER_RATIO)):
        sel = [r for r in rows if pick(r) and r["mxfp8"] is not None]
        if not sel:
            lines.append(f"- {group} layers: none")
            continue
        wins = sum(r["mxfp8"] < r["fp8"] for r in sel)
        wins_r = sum(r["mxfp8r"] < r["fp8"] for r in sel)
        gm = math.exp(sum(math.log(r["mxfp8"] / r["fp8"]) for r in sel) / len(sel))
        gmr = math.exp(sum(math.log(r["mxfp8r"] / r["fp8"]) for r in sel) / len(sel))
        gn = math.exp(sum(math.log(r["nvfp4"] / r["fp8"]) for r in sel) / len(sel))
        lines.append(
            f"- {group} layers ({len(sel)}): mxfp8 beats per-tensor fp8 on {wins}/{len(sel)} "
            f"(mxfp8r on {wins_r}/{len(sel)}); "
            f"local error vs fp8 (geometric mean): mxfp8 {gm:.2f}x, mxfp8r {gmr:.2f}x, "
            f"nvfp4 {gn:.2f}x")
    lines.append("")
    return lines


def outlier_sweep() -> list[str]:
    """A 2048->2048 Linear (seeded random init) on randn inputs whose every 64th channel is
    scaled by r: where does per-block scaling start to pay?"""
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(2048, 2048)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2048, 2048, generator=g) / 2048**0.5)
        lin.bias.zero_()
    base = torch.randn(256, 2048, generator=g)  # (tokens, K)
    small = torch.ones(2048, dtype=torch.bool)
    small[::64] = False  # the non-outlier channels
    lines = ["### outlier sweep (synthetic 2048->2048 Linear, every 64th input channel x r)", "",
             "Output = local error of the layer's output; small x = relative L2 error of the "
             "quantised input on the non-outlier channels only.", "",
             "| r | fp8 | mxfp8 | mxfp8r | nvfp4 | small x: fp8 | mxfp8 | mxfp8r | nvfp4 |",
             "|---|---|---|---|---|---|---|---|---|"]
    with torch.no_grad():
        wq = {fmt: QUANT[fmt](lin.weight) for fmt in FORMATS}
        for r in (1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6):
            x = base.clone()
            x[:, ~small] *= r
            y = lin(x)
            out, sx = [], []
            for fmt in FORMATS:
                yq = _gemm(fmt, x, wq[fmt], lin.bias)
                out.append(_pct(float((yq - y).norm() / y.norm())))
                xq = QUANT[fmt](x)
                sx.append(_pct(float((xq - x)[:, small].norm() / x[:, small].norm())))
            lines.append(f"| {r:g} | " + " | ".join(out) + " | " + " | ".join(sx) + " |")
    lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["wide", "minilm"])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = ["# Block-scaled formats: per-layer error (emulated)", "",
             "Generated by `benchmarks/blockscale_error.py` (torch "
             f"{torch.__version__}, CPU). Local = relative L2 error of the layer's output "
             "with input and weight quantised, on its fp32 input; e2e = relative L2 error of "
             "the model output with that layer alone lowered. fp8 = per-tensor e4m3 current "
             "scaling; mxfp8 = OCP MX (E4M3, E8M0 per 32 along K, spec floor scale); "
             "mxfp8r = the same with NVIDIA's rceil scale; nvfp4 = E2M1, E4M3 per 16 along K "
             "x per-tensor fp32. Outlier ratio = max/median over input columns of the "
             f"column's max|x| (outlier layer: >= {OUTLIER_RATIO:g}). — = ineligible.", ""]
    t0 = time.perf_counter()
    for m in args.models:
        name, rows, whole = measure(example(m))
        lines += table(name, rows, whole)
    lines += outlier_sweep()
    lines += [
        "How to read it: e4m3 is a float, so per-tensor scaling keeps values far below the "
        "tensor max at full relative precision until they reach e4m3's subnormals (about "
        "2**-6 / 448, i.e. outliers ~1e4x the typical value); only beyond that does MX's "
        "per-block scale keep them (the sweep's small-x columns). Below it, MX with the "
        "spec's floor scale is worse than per-tensor fp8: the floor puts a block's max in "
        "[256, 512) x 2**e and the part above 448 saturates (up to 12.5% on exactly the "
        "largest values); NVIDIA's rceil scale (mxfp8r) does not saturate and matches "
        "per-tensor fp8. NVFP4's E2M1 elements (1 mantissa bit) cost ~3.5x fp8's error, and "
        "within a 16-block an outlier flushes its neighbours (E2M1 spans only 0.5..6).", "",
        f"Wall time: {time.perf_counter() - t0:.0f} s.",
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.out)
    print(text)


if __name__ == "__main__":
    main()
