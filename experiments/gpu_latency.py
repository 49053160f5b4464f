"""Measured vs estimated latency of a GPT-style stack on a GPU, per precision.

One go on a lent GPU (made for an H200; ~1-2 min after CUDA start-up):

1. builds a pre-LN GPT stack (default d_model 4096, 32 heads, seq 2048, batch 8, 4 blocks;
   fp32 master weights) and traces it at batch 1 with ``autoprec.trace`` (the cost model
   rescales to the measured batch: "price at the deployment shape");
2. micro-benchmarks single GEMMs per precision, a copy and a tiny op, and fits the
   profile's efficiency factors, bandwidth factor and launch overhead on them
   (``autoprec.cost.calibrate``; the whole-model runs are never used for fitting);
3. measures the stack all-fp32, all-tf32, all-bf16, all-fp16, all-fp8 (Linear layers; the
   attention core stays bf16, as DESIGN.md's fp8 rule says) and a mixed assignment, with
   CUDA events after warm-up;
4. reports the prediction error per run, datasheet vs calibrated profile (target: within
   15% calibrated), and writes results.csv, results.md and <profile>.calibration.yaml
   under the output directory (--out, else $OUT, else ./gpu_latency_out).

fp8 runs without Transformer Engine: ``torch._scaled_mm`` (no backward; K, N % 16 == 0;
second operand column-major), weights quantised once, the input per call with current
scaling (amax -> scale -> scaled cast; the cast fused by ``torch.compile`` on CUDA, as the
cost model and Transformer Engine assume, else two eager passes). ``--fp8-impl autoprec`` times
``autoprec.apply.fp8.fp8_linear(backend="torch")`` instead (weights re-quantised per call).

``--dry-run`` runs everything on the CPU at toy sizes (wall clock, profile still the GPU's):
it checks the script, not the numbers. Without CUDA and without --dry-run it says why and
exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.cost import CostModel, Sample, fit, get_profile, measure_latency
from autoprec.cost.calibrate import copy_graph, gemm_graph
from autoprec.trace.graph import LayerGraph, LayerNode

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # OCP FP8 spec, e4m3 max normal
RUN_PRECS = ("fp32", "tf32", "bf16", "fp16", "fp8")


# --------------------------------------------------------------------------- model


class Fp8Cache:
    """A Linear's weight quantised once to e4m3 (per-tensor scale), column-major for
    ``torch._scaled_mm``'s second operand."""

    def __init__(self, lin: nn.Linear) -> None:
        w = lin.weight.detach()  # (N, K)
        amax = w.abs().amax().float().clamp(min=1e-12)
        scale = E4M3_MAX / amax
        self.wq_t = (w.float() * scale).to(E4M3).t()  # (K, N), column-major view
        self.inv_scale = (1.0 / scale).reshape(())
        self.bias = None if lin.bias is None else lin.bias.detach().to(torch.bfloat16)


def _quantize_eager(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling: (x * 448 / amax(x)) in e4m3, and the dequantisation factor."""
    amax = torch.linalg.vector_norm(x2, ord=math.inf).float()  # one reduction kernel
    scale = E4M3_MAX / amax.clamp(min=1e-12)
    return (x2 * scale).to(E4M3), (1.0 / scale).reshape(())


#: The quantiser in use: eager (mul and cast are two passes) or torch.compile'd (fused).
_QUANT: dict[str, Any] = {"fn": _quantize_eager, "how": "eager"}


def setup_quantizer(mode: str, device: torch.device) -> str:
    """Compile the input quantiser once per input dtype (outside any timed region)."""
    if mode != "compiled":
        return "eager (mul and cast: two passes over the input)"
    t0 = time.perf_counter()
    try:
        fn = torch.compile(_quantize_eager, dynamic=True)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            fn(torch.randn(64, 128, device=device, dtype=dt))
    except Exception as err:  # report and measure the eager path instead
        return f"eager (torch.compile failed: {type(err).__name__}: {str(err)[:200]})"
    _QUANT["fn"], _QUANT["how"] = fn, "compiled"
    return f"compiled (fused scaled cast; compile {time.perf_counter() - t0:.0f}s)"


def fp8_cached_linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """y = x W^T + b with e4m3 operands; x scaled per tensor on every call; bf16 out."""
    cache: Fp8Cache = lin._fp8_cache  # type: ignore[attr-defined]
    shape = x.shape
    xq, inv_sx = _QUANT["fn"](x.reshape(-1, shape[-1]))  # (M, K) e4m3
    y = torch._scaled_mm(xq, cache.wq_t, scale_a=inv_sx, scale_b=cache.inv_scale,
                         bias=cache.bias, out_dtype=torch.bfloat16)
    return y.reshape(*shape[:-1], y.shape[-1])


class AttentionCore(nn.Module):
    """SDPA on the fused qkv projection: (B, T, 3C) -> (B, T, C)."""

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        B, T, C3 = qkv.shape
        C = C3 // 3
        q, k, v = qkv.view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, hd); non-causal: FLOPs exact
        return y.transpose(1, 2).reshape(B, T, C)


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.core = AttentionCore(n_head)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.core(self.qkv(x)))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block (nanoGPT layout)."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTStack(nn.Module):
    def __init__(self, d: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x)


def analytic_graph(d: int, T: int, n_layer: int) -> LayerGraph:
    """The stack's LayerGraph for one sequence, by hand (a cross-check of the tracer).

    Unlike the traced graph it records what the tracer cannot see: the residual adds in
    each block's own code (fp32: the stream starts at the fp32 input and ``x + y``
    promotes), and that qkv / fc1 read the fp32 stream through a LayerNorm.
    ``inputs_from=[""]`` names no GEMM: the fp32 stream.
    """
    nodes: list[LayerNode] = []

    def add(path: str, kind: str, flops: int = 0, w: int = 0, i: int = 0, o: int = 0,
            src: list[str] | None = None, leaf: bool = True) -> None:
        nodes.append(LayerNode(path=path, module_type=kind, kind=kind, is_leaf=leaf, depth=1,
                               calls=1, flops=flops, weight_elems=w, in_elems=i, out_elems=o,
                               inputs_from=src or []))

    def linear(path: str, k: int, n: int, src: list[str]) -> None:
        add(path, "linear", 2 * T * k * n, k * n + n, T * k, T * n, src)

    Td = T * d
    edges = []
    for b in range(n_layer):
        p = f"blocks.{b}"
        add(p, "container", 2 * Td, 0, 4 * Td, 2 * Td, [""], leaf=False)  # two residual adds
        add(f"{p}.ln1", "norm", 0, 2 * d, Td, Td, [""])
        linear(f"{p}.attn.qkv", d, 3 * d, [])
        add(f"{p}.attn.core", "attention", 4 * T * T * d, 0, 3 * Td, Td, [f"{p}.attn.qkv"])
        linear(f"{p}.attn.proj", d, d, [f"{p}.attn.core"])
        add(f"{p}.ln2", "norm", 0, 2 * d, Td, Td, [""])
        linear(f"{p}.mlp.fc1", d, 4 * d, [])
        add(f"{p}.mlp.act", "activation", 0, 0, 4 * Td, 4 * Td, [f"{p}.mlp.fc1"])
        linear(f"{p}.mlp.fc2", 4 * d, d, [f"{p}.mlp.fc1"])
        edges += [(f"{p}.attn.qkv", f"{p}.attn.core"), (f"{p}.attn.core", f"{p}.attn.proj"),
                  (f"{p}.mlp.fc1", f"{p}.mlp.fc2")]
    add("ln_f", "norm", 0, 2 * d, Td, Td, [""])
    return LayerGraph(nodes={n.path: n for n in nodes}, tracer="manual", batch_size=1,
                      edges=edges, model_name="gpt-stack (analytic)")


# --------------------------------------------------------------------------- policies


def install(model: nn.Module, assignment: Mapping[str, str], fp8_impl: str) -> None:
    """Give every assigned module a forward computing in its precision."""
    from autoprec.apply.lower import lowered_forward

    mods = dict(model.named_modules())
    for path, prec in assignment.items():
        mod = mods[path]
        mod.__dict__.pop("forward", None)
        if prec == "fp8" and fp8_impl == "cached":
            if not hasattr(mod, "_fp8_cache"):
                mod._fp8_cache = Fp8Cache(mod)  # once, outside the timed region
            mod.forward = (lambda m: lambda x: fp8_cached_linear(m, x))(mod)
        elif prec == "fp8":
            mod.forward = lowered_forward(mod, "fp8", fp8_backend="torch")
        else:
            mod.forward = lowered_forward(mod, prec)


def uninstall(model: nn.Module) -> None:
    for mod in model.modules():
        mod.__dict__.pop("forward", None)


def uniform(graph_paths: list[str], kinds: Mapping[str, str], prec: str) -> dict[str, str]:
    """Every GEMM node in ``prec``; fp8 only on Linear leaves (attention core -> bf16)."""
    return {p: ("bf16" if prec == "fp8" and kinds[p] != "linear" else prec)
            for p in graph_paths}


def mixed(graph_paths: list[str], kinds: Mapping[str, str], n_layer: int) -> dict[str, str]:
    """A plausible tuned policy: first and last block bf16, big MLP GEMMs fp8 elsewhere,
    attention projections fp16, attention core bf16, one block tf32."""
    out = {}
    for p in graph_paths:
        blk = int(p.split(".")[1]) if p.startswith("blocks.") else 0
        if kinds[p] != "linear" or blk in (0, n_layer - 1):
            out[p] = "bf16"
        elif blk == 1 and n_layer > 3:
            out[p] = "tf32"
        elif ".mlp." in p:
            out[p] = "fp8"
        else:
            out[p] = "fp16"
    return out


# --------------------------------------------------------------------------- helpers


def fp8_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None  # _scaled_mm runs on the CPU in recent torch (dry run)
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"fp8: torch._scaled_mm needs SM >= 8.9, this GPU is SM {cap[0]}.{cap[1]}"
    return None


def micro_samples(profile, device: torch.device, dims: tuple[int, int, int, int],
                  precs: tuple[str, ...], fp8_impl: str, timer: Callable) -> list[Sample]:
    """Single-GEMM, copy and tiny-op measurements for the calibration fit."""
    d, tokens, _, _ = dims
    shapes = {(tokens, d, d), (tokens, d, 4 * d), (tokens, 4 * d, d), (max(16, tokens // 64), d, d)}
    out = []
    for m, k, n in sorted(shapes):
        lin = nn.Sequential(nn.Linear(k, n, device=device))
        x = torch.randn(m, k, device=device)
        cm = CostModel(gemm_graph(m, k, n), profile)
        for prec in precs:
            install(lin, {"0": prec}, fp8_impl)
            out.append(Sample(cm, {"gemm": prec}, timer(lambda lin=lin, x=x: lin(x)),
                              f"gemm {m}x{k}x{n} {prec}"))
            uninstall(lin)
        del lin, x
    elems = tokens * d
    x = torch.randn(elems, device=device)
    out.append(Sample(CostModel(copy_graph(elems), profile), {}, timer(lambda: x.clone()),
                      f"copy {elems}"))
    y = torch.randn(16, device=device)
    out.append(Sample(CostModel(copy_graph(16), profile), {}, timer(lambda: y.add(1.0)),
                      "tiny add"))
    return out


def write_results(out_dir: Path, rows: list[dict[str, Any]], header: list[str],
                  calib_text: str, micro_rows: list[dict[str, Any]]) -> None:
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    df.to_csv(out_dir / "results.csv", index=False)
    pd.DataFrame(micro_rows).to_csv(out_dir / "micro.csv", index=False)
    lines = ["# gpu_latency results", "", *[f"- {h}" for h in header], "",
             "| run | measured ms | p10 | p90 | est (datasheet) ms | err | est (calibrated) ms "
             "| err | analytic graph, calibrated: err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['measured_ms']:.3f} | {r['p10_ms']:.3f} | "
                     f"{r['p90_ms']:.3f} | {r['est_datasheet_ms']:.3f} | "
                     f"{r['err_datasheet']:+.1%} | {r['est_calibrated_ms']:.3f} | "
                     f"{r['err_calibrated']:+.1%} | {r['err_analytic_calibrated']:+.1%} |")
    lines += ["", "## calibration", "", "```yaml", calib_text.rstrip(), "```", ""]
    (out_dir / "results.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: $OUT, else ./gpu_latency_out)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script")
    ap.add_argument("--profile", default="h200", help="device profile to predict with")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fp8-impl", choices=("cached", "autoprec"), default="cached")
    ap.add_argument("--fp8-cast", choices=("compiled", "eager"), default=None,
                    help="input quantiser of the cached fp8 path (default: compiled on CUDA, "
                         "eager on CPU; falls back to eager if torch.compile fails)")
    args = ap.parse_args(argv)
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_latency_out")  # CLI boundary

    if args.dry_run:
        device = torch.device("cpu")
        args.d_model, args.heads, args.seq, args.batch, args.layers = 64, 2, 16, 2, 2
        args.warmup, args.repeats = 1, 2
    elif not torch.cuda.is_available():
        print(f"gpu_latency: no CUDA device (torch {torch.__version__}, "
              f"cuda build: {torch.version.cuda}); nothing measured. "
              "Run on a GPU machine, or pass --dry-run to check the script on CPU.",
              file=sys.stderr)
        return 1
    else:
        device = torch.device("cuda")
    t_start = time.perf_counter()
    profile = get_profile(args.profile)
    clock = "cuda" if device.type == "cuda" else "cpu"

    def timer(run: Callable[[], Any], warmup: int = args.warmup,
              repeats: int = args.repeats) -> float:
        with torch.no_grad():
            return measure_latency(run, clock, warmup, repeats).median_s

    torch.manual_seed(0)
    d, H, T, B, L = args.d_model, args.heads, args.seq, args.batch, args.layers
    if d % 16 or d % H:
        print(f"gpu_latency: d_model {d} must be a multiple of 16 and of heads {H}",
              file=sys.stderr)
        return 2
    with device:  # initialise on the device: 0.8 G parameters at the default size
        model = GPTStack(d, H, L).eval()

    fp8_wc = "per_call" if args.fp8_impl == "autoprec" else "once"
    cm_hand = CostModel(analytic_graph(d, T, L), profile, batch_size=B, fp8_weight_cast=fp8_wc)
    try:
        from autoprec.trace import trace

        with torch.no_grad():
            graph = trace(model, torch.randn(1, T, d, device=device))  # traced at batch 1
        cm = CostModel(graph, profile, batch_size=B, fp8_weight_cast=fp8_wc)
        if cm.paths != cm_hand.paths:
            raise RuntimeError(f"traced GEMM nodes {cm.paths} differ from the model's")
    except Exception as err:  # the analytic graph still lets the run report something
        print(f"tracing failed ({type(err).__name__}: {err}); using the analytic graph",
              flush=True)
        graph, cm = cm_hand.graph, cm_hand
    kinds = {n.path: n.kind for n in cm.gemm}
    paths = cm.paths

    why_no_fp8 = fp8_reason(device)
    precs = tuple(p for p in RUN_PRECS if not (p == "fp8" and why_no_fp8))
    quant = "n/a"
    if "fp8" in precs and args.fp8_impl == "cached":
        quant = setup_quantizer(args.fp8_cast or ("compiled" if device.type == "cuda"
                                                  else "eager"), device)
        print(f"fp8 input quantiser: {quant}", flush=True)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"torch {torch.__version__}; model d={d} heads={H} seq={T} batch={B} layers={L}; "
          f"graph: {len(paths)} GEMM nodes via {graph.tracer}, flow: {cm.flow}"
          + (f"; skipped {why_no_fp8}" if why_no_fp8 else ""), flush=True)

    # 1. calibrate on micro-benchmarks
    micro = micro_samples(profile, device, (d, B * T, H, L), precs, args.fp8_impl, timer)
    fitres = fit(profile, micro, note=f"gpu_latency.py micro-benchmarks on "
                 f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
                 f"torch {torch.__version__}")
    cal_path = fitres.calibration.save(out_dir / f"{profile.name}.calibration.yaml")
    cm_cal = cm.with_profile(fitres.profile)
    cm_hand_cal = cm_hand.with_profile(fitres.profile)
    micro_rows = [{"sample": s.label, "measured_ms": s.seconds * 1e3,
                   "fit_ms": p * 1e3, "err": (p - s.seconds) / s.seconds}
                  for s, p in zip(micro, fitres.predicted, strict=True)]
    print(f"calibrated on {len(micro)} micro-benchmarks (rel. RMSE "
          f"{fitres.calibration.rel_rmse:.1%}): {fitres.calibration.to_dict()}", flush=True)

    # 2. whole-model runs
    runs = [(f"all-{p}", uniform(paths, kinds, p)) for p in precs]
    runs.append(("mixed", mixed(paths, kinds, L) if "fp8" in precs
                 else {k: ("bf16" if v == "fp8" else v)
                       for k, v in mixed(paths, kinds, L).items()}))
    x = torch.randn(B, T, d, device=device)
    rows = []
    for name, assignment in runs:
        install(model, assignment, args.fp8_impl)
        with torch.no_grad():
            timing = measure_latency(lambda: model(x), clock, args.warmup, args.repeats)
        uninstall(model)
        est, est_c = cm.estimate(assignment), cm_cal.estimate(assignment)
        m = timing.median_s
        rows.append({"run": name, "measured_ms": m * 1e3, "p10_ms": timing.p10 * 1e3,
                     "p90_ms": timing.p90 * 1e3, "est_datasheet_ms": est * 1e3,
                     "err_datasheet": (est - m) / m, "est_calibrated_ms": est_c * 1e3,
                     "err_calibrated": (est_c - m) / m,
                     "est_analytic_calibrated_ms": cm_hand_cal.estimate(assignment) * 1e3,
                     "err_analytic_calibrated": (cm_hand_cal.estimate(assignment) - m) / m,
                     "n_by_precision": ",".join(f"{p}:{sum(v == p for v in assignment.values())}"
                                                for p in RUN_PRECS)})
        print(f"{name:<10} measured {m * 1e3:9.3f} ms  datasheet {est * 1e3:9.3f} ms "
              f"({(est - m) / m:+.1%})  calibrated {est_c * 1e3:9.3f} ms "
              f"({(est_c - m) / m:+.1%})  analytic graph, calibrated "
              f"{rows[-1]['err_analytic_calibrated']:+.1%}", flush=True)

    worst = max(abs(r["err_calibrated"]) for r in rows)
    header = [f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
              f"{' (DRY RUN: toy sizes on CPU, numbers meaningless)' if args.dry_run else ''}",
              f"torch {torch.__version__}, python {platform.python_version()}",
              f"model: GPT stack d={d} heads={H} seq={T} batch={B} layers={L}; "
              f"{len(paths)} GEMM nodes traced at batch 1 ({graph.tracer}), priced at batch {B}",
              f"fp8: {args.fp8_impl}, input quantiser {quant}"
              + (f" (skipped: {why_no_fp8})" if why_no_fp8 else ""),
              f"profile: {profile.name}; calibration: {cal_path.name}",
              f"worst calibrated error: {worst:.1%} (target 15%)",
              f"wall time: {time.perf_counter() - t_start:.0f}s"]
    import yaml

    write_results(out_dir, rows, header, yaml.safe_dump(fitres.calibration.to_dict(),
                                                        sort_keys=False), micro_rows)
    print(f"worst calibrated error {worst:.1%} (target 15%); wrote {out_dir}/results.csv, "
          f"results.md, micro.csv, {cal_path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
