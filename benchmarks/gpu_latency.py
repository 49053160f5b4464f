"""Measured vs estimated latency of a GPT-style stack on a GPU: policies, global autocast.

Forward (inference) latency only; training steps (forward + backward + AdamW, fp8 through
torchao) are timed by ``benchmarks/gpu_train_step.py``.

One go on a lent GPU (made for an H200; a few minutes including CUDA start-up):

1. builds a pre-LN GPT stack (default d_model 4096, 32 heads, seq 2048, batch 8, 4 blocks;
   fp32 master weights) and traces it at batch 1 with ``autoprec.trace`` (the graph carries
   the op trace of one real forward; the cost model replays it under each plan and scales
   activations to the measured batch: "price at the deployment shape");
2. micro-benchmarks single GEMMs at several shapes per precision (fp32, tf32, bf16, fp16,
   and fp8 through the ``torch`` backend when ``capability("fp8", "torch")`` says ok), a
   copy and a tiny add, each run as autoprec runs it (``apply_policy`` on a one-GEMM
   container: ``calibrate.gemm_graph`` / ``copy_graph`` price the same kernels), and fits
   the profile's efficiency factors, bandwidth factor and launch overhead on them
   (``calibrate.fit``; the whole-model runs are never used for fitting);
3. times the stack with CUDA events after warm-up (``autoprec.cost.measure_latency``):
   all-fp32 (tf32 off), all-tf32 (``torch.backends.cuda.matmul.allow_tf32``), one global
   ``torch.autocast`` in bf16 and in fp16, ``Policy(default="bf16")``,
   ``Policy(default="fp16")``, an fp8 mix (``default: bf16`` + fp8 on the big Linear
   leaves — qkv, fc1, fc2 — through ``torch._scaled_mm``) and the old per-leaf islands
   (``default: fp32`` + one bf16 rule per GEMM leaf); every policy is audited on a real
   forward first (each GEMM computed in its planned precision);
4. prints measured vs estimated (``CostModel.estimate``) speed-up over fp32, the ratio
   policy / global autocast of the same dtype, casts per forward, and the prediction error
   with the datasheet and the calibrated profile; writes results.csv, results.md,
   micro.csv and <profile>.calibration.yaml (``Calibration.save``) under --out (else $OUT,
   else ./gpu_latency_out).

5. compiled (``--compile``, the default on a GPU): the same stack ``torch.compile``d
   (inductor, after ``apply_policy``; one fresh compile per run) for all-fp32, the global
   bf16 autocast, ``default: bf16``, the fp8 mix and the per-leaf islands, timed the same
   way and priced by ``CostModel(..., mode="compile")`` (cost/compiled.py: GEMMs/SDPA extern, casts and
   pointwise ops fused between them; Triton: one kernel per data-connected group) with the
   datasheet and the calibrated profile (GEMM efficiencies carry over: the extern GEMMs
   are the eager ones); written to compiled.csv and a second table in results.md. A
   compile that fails is recorded with its error, not fatal.

A global autocast is priced as ``Policy(default=...)``, which runs the same kernels (its
weight-cast cache saves nothing when each weight is read once per forward). The all-tf32
run flips the global flag, priced as ``Policy(default="tf32")``.

``--dry-run`` runs everything on the CPU at toy sizes (wall clock; the profile stays the
GPU's, policies applied for that target, fp8 through the emulated backend): it checks the
script, not the numbers. Without CUDA and without --dry-run it says why and exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, Sample, fit, get_profile
from autoprec.device.capability import capability
from autoprec.measure import gpu_shapes, measure_latency
from autoprec.measure import micro_samples as micro_benchmarks
from autoprec.policy import Policy, PolicyWarning, gemm_leaf_paths
from autoprec.trace import trace

# --------------------------------------------------------------------------- model


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


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One way of running the stack, and the plan the cost model prices for it."""

    name: str
    priced: Policy  # what the cost model prices
    applied: Policy | None = None  # apply_policy'd around the forward (None: bare model)
    ctx: Callable[[], AbstractContextManager[Any]] = nullcontext  # entered per forward
    tf32: bool = False  # torch.backends.{cuda.matmul,cudnn}.allow_tf32 during the run
    versus: str | None = None  # the global-autocast run it is compared with


def big_linears(model: nn.Module, d: int) -> list[str]:
    """fp8 targets: Linear leaves with at least 3 d^2 weights (qkv, fc1, fc2; not proj)."""
    return [p for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.weight.numel() >= 3 * d * d]


def runs(model: nn.Module, d: int, device: str, fp8_ok: bool) -> list[Run]:
    leaves = gemm_leaf_paths(model)

    def autocast(dtype: torch.dtype) -> Callable[[], Any]:
        return lambda: torch.autocast(device, dtype=dtype)

    out = [
        Run("all-fp32", Policy(default="fp32")),
        Run("all-tf32 (global flag)", Policy(default="tf32"), tf32=True),
        Run("global autocast bf16", Policy(default="bf16"), ctx=autocast(torch.bfloat16)),
        Run("global autocast fp16", Policy(default="fp16"), ctx=autocast(torch.float16)),
        Run("default: bf16", Policy(default="bf16"), Policy(default="bf16"),
            versus="global autocast bf16"),
        Run("default: fp16", Policy(default="fp16"), Policy(default="fp16"),
            versus="global autocast fp16"),
    ]
    if fp8_ok:
        mix = Policy(default="bf16", layers=dict.fromkeys(big_linears(model, d), "fp8"))
        out.append(Run("fp8 mix (bf16 + fp8 qkv/fc1/fc2)", mix, mix,
                       versus="global autocast bf16"))
    islands = Policy(default="fp32", layers=dict.fromkeys(leaves, "bf16"))
    out.append(Run("per-leaf islands (fp32 + bf16 per leaf)", islands, islands,
                   versus="global autocast bf16"))
    return out


@contextmanager
def tf32_flags(on: bool) -> Iterator[None]:
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# --------------------------------------------------------------------------- calibration


def micro_samples(profile, device: torch.device, d: int, tokens: int, target: str,
                  fp8_backend: str | None, timer: Callable[[Callable[[], Any]], float]
                  ) -> list[Sample]:
    """Single GEMMs per precision, a copy and a tiny add, for the calibration fit: the
    micro-benchmarks ``autoprec tune`` runs on a local target
    (``autoprec.measure.micro_samples``: each GEMM applied as autoprec applies it).
    """
    plans = {p: Policy(default=p) for p in ("fp32", "tf32", "bf16", "fp16")}
    if fp8_backend is not None:
        plans["fp8"] = Policy(default="bf16", layers={"gemm": "fp8"})

    def run_as(module: nn.Module, pol: Policy) -> Any:
        return apply_policy(module, pol, target=target, fp8_backend=fp8_backend)

    return micro_benchmarks(profile, plans, gpu_shapes(d, tokens), timer,
                                   run_as, device=str(device), copy_elems=tokens * d)


# --------------------------------------------------------------------------- compiled

#: The runs measured compiled too (each one is a fresh inductor compile).
COMPILED = ("all-fp32", "global autocast bf16", "default: bf16",
            "fp8 mix (bf16 + fp8 qkv/fc1/fc2)", "per-leaf islands (fp32 + bf16 per leaf)")


def compiled_rows(model: nn.Module, x: torch.Tensor, plan: list[Run], cm: CostModel,
                  cm_cal: CostModel, target: str, fp8_backend: str | None,
                  timer: Callable[[Callable[[], Any]], float]) -> list[dict[str, Any]]:
    """Time the COMPILED runs under ``torch.compile`` and price them in compile mode."""
    rows: list[dict[str, Any]] = []
    for r in plan:
        if r.name not in COMPILED:
            continue
        row: dict[str, Any] = {"run": r.name, "est_ms": cm.estimate(r.priced) * 1e3,
                               "est_cal_ms": cm_cal.estimate(r.priced) * 1e3,
                               "kernels_est": cm.breakdown(r.priced).kernels}
        try:
            with tf32_flags(r.tf32), (nullcontext() if r.applied is None else apply_policy(
                    model, r.applied, target=target, fp8_backend=fp8_backend)):
                torch._dynamo.reset()
                compiled = torch.compile(model)

                def fwd(r: Run = r, compiled: Any = compiled) -> Any:
                    with r.ctx():
                        return compiled(x)

                t0 = time.perf_counter()
                with torch.no_grad():
                    fwd()
                row["compile_s"] = time.perf_counter() - t0
                row["measured_ms"] = timer(fwd) * 1e3
        except Exception as err:  # a compile failure is a result, not the end of the run
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            row["measured_ms"] = float("nan")
        print(f"{'compiled ' + r.name:<53} {row['measured_ms']:9.3f} ms"
              + (f"  ({row['error']})" if "error" in row else ""), flush=True)
        rows.append(row)
    torch._dynamo.reset()
    fp32 = next((r for r in rows if r["run"] == "all-fp32"), None)
    for r in rows:
        m = r["measured_ms"]
        r["err"] = (r["est_ms"] - m) / m
        r["err_cal"] = (r["est_cal_ms"] - m) / m
        if fp32 is not None:
            r["speedup_measured"] = fp32["measured_ms"] / m
            r["speedup_est_cal"] = fp32["est_cal_ms"] / r["est_cal_ms"]
    return rows


def compiled_table(rows: list[dict[str, Any]]) -> str:
    out = ["| run (torch.compile) | measured ms | est ms | est ms (cal) | speed-up measured | "
           "speed-up est (cal) | kernels est | err (cal) | compile s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['measured_ms']:.3f} | {r['est_ms']:.3f} | "
                   f"{r['est_cal_ms']:.3f} | {r.get('speedup_measured', math.nan):.2f}x | "
                   f"{r.get('speedup_est_cal', math.nan):.2f}x | {r['kernels_est']} | "
                   f"{r['err_cal']:+.1%} | {r.get('compile_s', math.nan):.0f} |"
                   + (f" {r['error']}" if "error" in r else ""))
    return "\n".join(out)


# --------------------------------------------------------------------------- output


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["run", "measured ms", "est ms", "est ms (cal)", "speed-up measured",
            "speed-up est", "speed-up est (cal)", "/ autocast measured", "/ autocast est",
            "casts + weight casts", "err", "err (cal)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def f(v: Any, spec: str) -> str:
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    for r in rows:
        out.append("| " + " | ".join([
            r["run"], f(r["measured_ms"], ".3f"), f(r["est_ms"], ".3f"),
            f(r["est_cal_ms"], ".3f"), f(r["speedup_measured"], ".2f") + "x",
            f(r["speedup_est"], ".2f") + "x", f(r["speedup_est_cal"], ".2f") + "x",
            f(r["vs_autocast_measured"], ".3f"), f(r["vs_autocast_est"], ".3f"),
            f"{r['casts']} + {r['weight_casts']}", f(r["err"], "+.1%"),
            f(r["err_cal"], "+.1%")]) + " |")
    return "\n".join(out)


def write_results(out_dir: Path, rows: list[dict[str, Any]], header: list[str],
                  calib_text: str, micro_rows: list[dict[str, Any]],
                  compiled: list[dict[str, Any]] | None = None) -> None:
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out_dir / "results.csv", index=False)
    pd.DataFrame(micro_rows).to_csv(out_dir / "micro.csv", index=False)
    micro = ["| sample | measured ms | fitted ms | err |", "|---|---|---|---|"]
    micro += [f"| {r['sample']} | {r['measured_ms']:.4f} | {r['fit_ms']:.4f} | "
              f"{r['err']:+.1%} |" for r in micro_rows]
    extra: list[str] = []
    if compiled:
        pd.DataFrame(compiled).to_csv(out_dir / "compiled.csv", index=False)
        extra = ["## compiled (torch.compile, inductor; priced by CostModel(mode='compile'))", "",
                 compiled_table(compiled), ""]
    lines = ["# gpu_latency results", "", *[f"- {h}" for h in header], "", table(rows), "",
             *extra,
             "## calibration (fitted on the micro-benchmarks only)", "", "```yaml",
             calib_text.rstrip(), "```", "", *micro, ""]
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
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="also measure compiled runs (default: on with CUDA, off for "
                         "--dry-run: CPU inductor compiles take minutes)")
    args = ap.parse_args(argv)
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_latency_out")  # CLI boundary

    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # toy sizes: threads only add noise on a shared machine
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
    warnings.simplefilter("ignore", PolicyWarning)  # hand-made policies: no fingerprint
    t_start = time.perf_counter()
    profile = get_profile(args.profile)
    clock = device.type
    dev_name = (torch.cuda.get_device_name() if device.type == "cuda"
                else f"cpu ({platform.processor() or platform.machine()})")

    def timer(run: Callable[[], Any]) -> float:
        with torch.no_grad():
            return measure_latency(run, clock, args.warmup, args.repeats).median_s

    torch.manual_seed(0)
    d, H, T, B, L = args.d_model, args.heads, args.seq, args.batch, args.layers
    if d % 16 or d % H:
        print(f"gpu_latency: d_model {d} must be a multiple of 16 and of heads {H}",
              file=sys.stderr)
        return 2
    with device:  # initialise on the device: 0.8 G parameters at the default size
        model = GPTStack(d, H, L).eval()
    with torch.no_grad(), tf32_flags(False):
        graph = trace(model, torch.randn(1, T, d, device=device), tracers=("hooks",))
    cm = CostModel(graph, profile, batch_size=B)

    ok, why = capability("fp8", "torch", device)
    fp8_backend: str | None = "torch" if ok else None
    fp8_note = f"fp8 backend torch ({why})" if ok else f"fp8 torch backend unavailable: {why}"
    if not ok and args.dry_run:  # check the code path anyway; numbers meaningless
        fp8_backend, fp8_note = "emulated", f"fp8 backend emulated (dry run; {why})"
    print(f"device: {dev_name}; torch {torch.__version__}; model d={d} heads={H} seq={T} "
          f"batch={B} layers={L}; op trace: {len(graph.ops.ops)} ops at batch 1, priced at "
          f"batch {B} on {profile.name}; {fp8_note}", flush=True)

    # 1. calibrate on micro-benchmarks
    with tf32_flags(False):
        micro = micro_samples(profile, device, d, B * T, args.profile, fp8_backend, timer)
    fitres = fit(profile, micro, note=f"gpu_latency.py micro-benchmarks on {dev_name}, "
                                      f"torch {torch.__version__}")
    cal_path = fitres.calibration.save(out_dir / f"{profile.name}.calibration.yaml")
    cm_cal = cm.with_profile(fitres.profile)
    micro_rows = [{"sample": s.label, "measured_ms": s.seconds * 1e3, "fit_ms": p * 1e3,
                   "err": (p - s.seconds) / s.seconds}
                  for s, p in zip(micro, fitres.predicted, strict=True)]
    print(f"calibrated on {len(micro)} micro-benchmarks (rel. RMSE "
          f"{fitres.calibration.rel_rmse:.1%}): {fitres.calibration.to_dict()}", flush=True)

    # 2. whole-model runs
    x = torch.randn(B, T, d, device=device)
    plan = runs(model, d, device.type, fp8_backend is not None)
    measured: dict[str, float] = {}
    audits: dict[str, str] = {}
    for r in plan:
        def fwd(r: Run = r) -> Any:
            with r.ctx():
                return model(x)

        with tf32_flags(r.tf32):
            if r.applied is None:
                measured[r.name] = timer(fwd)
            else:
                with apply_policy(model, r.applied, target=args.profile,
                                  fp8_backend=fp8_backend) as h:
                    with torch.no_grad():
                        rep = h.audit(fwd, strict=False)
                    audits[r.name] = ("ok" if rep.ok else
                                      "MISMATCH: " + "; ".join(rep.errors)[:200])
                    measured[r.name] = timer(fwd)
        print(f"{r.name:<44} {measured[r.name] * 1e3:9.3f} ms", flush=True)

    fp32_m = measured["all-fp32"]
    rows = []
    for r in plan:
        bd = cm.breakdown(r.priced)
        est, est_c, m = bd.total_s, cm_cal.estimate(r.priced), measured[r.name]
        vs_m = vs_e = float("nan")
        if r.versus is not None:
            vs_m = m / measured[r.versus]
            vs_e = est / cm.estimate(next(p.priced for p in plan if p.name == r.versus))
        rows.append({"run": r.name, "measured_ms": m * 1e3, "est_ms": est * 1e3,
                     "est_cal_ms": est_c * 1e3, "speedup_measured": fp32_m / m,
                     "speedup_est": cm.fp32_time / est,
                     "speedup_est_cal": cm_cal.fp32_time / est_c,
                     "vs_autocast_measured": vs_m, "vs_autocast_est": vs_e,
                     "casts": bd.casts, "weight_casts": bd.weight_casts,
                     "err": (est - m) / m, "err_cal": (est_c - m) / m,
                     "audit": audits.get(r.name, ""), "policy": r.priced.to_dict()})

    compiled: list[dict[str, Any]] = []
    if args.compile if args.compile is not None else not args.dry_run:
        ccm = CostModel(graph, profile, batch_size=B, mode="compile")
        compiled = compiled_rows(model, x, plan, ccm, ccm.with_profile(fitres.profile),
                                 args.profile, fp8_backend, timer)

    def summary(key: str) -> str:
        e = sorted(abs(r[key]) for r in rows)
        return f"median {e[len(e) // 2]:.1%}, worst {e[-1]:.1%}"

    header = [f"device: {dev_name}"
              f"{' (DRY RUN: toy sizes on CPU, numbers meaningless)' if args.dry_run else ''}",
              f"torch {torch.__version__}, python {platform.python_version()}; CUDA events "
              f"after {args.warmup} warm-up runs, median of {args.repeats}"
              if device.type == "cuda" else f"torch {torch.__version__}; wall clock",
              f"model: GPT stack d={d} heads={H} seq={T} batch={B} layers={L}; op trace "
              f"recorded at batch 1, priced at batch {B}; policies applied with "
              f"target={args.profile!r}",
              fp8_note, f"profile: {profile.name}; calibration: {cal_path.name} "
              f"(rel. RMSE on its micro-benchmarks {fitres.calibration.rel_rmse:.1%})",
              f"prediction error |est/measured - 1|: datasheet {summary('err')}; "
              f"calibrated {summary('err_cal')}",
              "audits: " + ", ".join(f"{k}: {v}" for k, v in audits.items()),
              f"wall time: {time.perf_counter() - t_start:.0f}s"]
    import yaml

    write_results(out_dir, rows, header, yaml.safe_dump(fitres.calibration.to_dict(),
                                                        sort_keys=False), micro_rows,
                  compiled)
    print("\n".join(header))
    print(table(rows))
    if compiled:
        print(compiled_table(compiled))
    print(f"wrote {out_dir}/results.csv, results.md, micro.csv, {cal_path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
