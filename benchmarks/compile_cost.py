"""Does the compile-mode cost model price what inductor really runs?

For each model and plan: apply the policy (``target="cpu"``), ``torch.compile`` it
(inductor, this CPU), read the generated code (``torch._inductor.utils.run_and_get_code``)
and count the kernels its ``call`` launches (``cpp_fused_*`` kernels + ``extern_kernels.*``
GEMMs + aten fallbacks) and the bytes its fused kernels are passed (``fused_bytes``);
time the compiled forward. The same plan is priced by
``CostModel(..., mode="compile")`` (autoprec/cost/compiled.py): its kernel count, and its time on a
profile calibrated here on *compiled* micro-benchmarks (single Linear per precision, an
elementwise op; never on the plans being ranked). Reported: per plan the priced vs launched
kernel count and inductor's ``generated_kernel_count`` (it counts C++ kernel bodies
generated, not launches: on CPU it is larger than the launches and is shown for
reference), estimated vs measured time; Spearman's rank correlation, median and worst
relative time error (pooled and per model).

Timing: one torch thread, the thread's CPU time (``measure_latency(clock="thread")``; the
team's 2-core machines are shared); each compiled forward is warmed up first.

    python -m benchmarks.compile_cost              # 4 models, ~20 plans (~10 min on 2 cores)
    python -m benchmarks.compile_cost --smoke      # one tiny model, 2 plans (tests)
    python -m benchmarks.compile_cost --models mixed8,wide --random 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, apply_calibration, fit, get_profile
from autoprec.measure import call_overhead, measure_latency, micro_samples
from autoprec.policy import Policy, PolicyWarning, gemm_leaf_paths
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file
from benchmarks.common import example

MODELS = {"mixed8": example("mixed8"), "wide": example("wide"),
          "nn_transformer": example("nn_transformer"),
          "minilm": example("minilm")}
PRECS = ("fp32", "bf16", "fp16")
_LAUNCH = re.compile(r"^\s*(?:[\w, ]+=\s*)?(cpp_fused_\w+|extern_kernels\.\w+|"
                     r"torch\.ops\.aten\.\w+(?:\.\w+)?)\(")


def timed(run: Any, warmup: int, repeats: int) -> float:
    return measure_latency(run, "cpu", warmup, repeats, clock="thread").median_s


def launches(code: str) -> dict[str, int]:
    """Kernels the generated ``call`` function launches: fused, extern, aten fallback."""
    out = {"fused": 0, "extern": 0, "fallback": 0}
    body = code.split("def call(", 1)[-1]
    body = body.split("\ndef ", 1)[0]
    for line in body.splitlines():
        m = _LAUNCH.match(line)
        if not m:
            continue
        name = m.group(1)
        kind = ("fused" if name.startswith("cpp_fused") else
                "extern" if name.startswith("extern") else "fallback")
        if kind == "fallback" and name.split(".")[3] in ("view", "reshape", "_reinterpret_tensor"):
            continue
        out[kind] += 1
    return out


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8,
                "int32": 4, "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1,
                "float8_e5m2": 1}
_ASSERT = re.compile(r"assert_size_stride\((\w+), \(([^)]*)\)")
_EMPTY = re.compile(r"(\w+) = empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
_REUSE = re.compile(r"(\w+) = (\w+); del \w+\s+# reuse")
_FUSED_CALL = re.compile(r"^\s*cpp_fused_\w+\(([^)]*)\)")


def _numel(shape: str) -> int:
    n = 1
    for d in (x.strip() for x in shape.split(",")):
        if d:
            n *= int(d)
    return n


def fused_bytes(code: str) -> float:
    """Bytes the generated ``call`` passes to its fused (``cpp_fused_*``) kernels: each
    buffer argument once, at its dtype (``empty_strided_cpu``); a graph input (a parameter
    or the model's input, sized by ``assert_size_stride``, no dtype written) counted as
    fp32. Inductor's own ``num_bytes_accessed`` counts Triton kernels only (0 on CPU)."""
    body = code.split("def call(", 1)[-1].split("\ndef ", 1)[0]
    size: dict[str, float] = {}
    total = 0.0
    for line in body.splitlines():
        if m := _ASSERT.search(line):
            size[m.group(1)] = _numel(m.group(2)) * 4.0
        if m := _EMPTY.search(line):
            size[m.group(1)] = _numel(m.group(2)) * _DTYPE_BYTES.get(m.group(3), 4)
        if (m := _REUSE.search(line)) and m.group(2) in size:
            size[m.group(1)] = size[m.group(2)]
        if m := _FUSED_CALL.match(line):
            total += sum(size.get(a.strip(), 0.0) for a in m.group(1).split(","))
    return total


def compile_and_count(net: nn.Module, run: Any, codes_out: list[str] | None = None
                      ) -> tuple[Any, dict[str, int], int]:
    """Compile ``net`` fresh, run it once; (compiled, launches, generated_kernel_count);
    the generated code is appended to ``codes_out`` when given."""
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    metrics.reset()
    compiled = torch.compile(net)
    _, codes = run_and_get_code(lambda: run(compiled))
    if codes_out is not None:
        codes_out.extend(codes)
    counts = {"fused": 0, "extern": 0, "fallback": 0}
    for code in codes:
        for k, v in launches(code).items():
            counts[k] += v
    return compiled, counts, int(metrics.generated_kernel_count)


def calibrate(profile: Any, repeats: int, smoke: bool) -> Any:
    """Fit the profile on compiled micro-benchmarks (``autoprec.cost.calibrate``, as
    ``tune --compile --target cpu`` calibrates this machine): single GEMMs per precision,
    a copy (8 MiB) and a tiny add, each less the per-forward time of a compiled call
    (``call_overhead``, kept in the profile for ``CostModel(..., mode="compile")``)."""
    per_call = call_overhead(lambda run: timed(run, 5, max(repeats, 25)))
    # large GEMMs pin the peaks, small ones the per-call set-up of 16-bit GEMMs (oneDNN's,
    # ~30 us here: it decides small layers)
    shapes = [(32, 64, 64)] if smoke else [(512, 512, 2048), (512, 2048, 512),
                                           (512, 1024, 1024), (512, 128, 128), (512, 64, 64)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        samples = micro_samples(profile, {p: Policy(default=p) for p in PRECS}, shapes,
                                lambda run: timed(run, 3, repeats),
                                lambda m, pol: apply_policy(m, pol, target="cpu"),
                                copy_elems=1 << (13 if smoke else 21), compile=True,
                                call_overhead_s=per_call)
    res = fit(profile, samples, fit_setup=True, note="compiled micro-benchmarks, "
              "benchmarks/compile_cost.py")
    res.calibration = dataclasses.replace(res.calibration, mode="compile",
                                          call_overhead_s=per_call)
    res.profile = apply_calibration(profile, res.calibration)
    return res


def plans(net: nn.Module, n_random: int, rng: random.Random) -> list[tuple[str, Policy]]:
    """Regions, per-leaf islands, a region with exceptions, random mixes."""
    leaves = gemm_leaf_paths(net)
    half = len(leaves) // 2
    out = [(f"default {p}", Policy(default=p)) for p in PRECS]
    out += [("fp32 + bf16 per leaf", Policy(default="fp32", layers=dict.fromkeys(leaves,
                                                                                 "bf16"))),
            ("bf16 + fp32 first half", Policy(default="bf16",
                                              layers=dict.fromkeys(leaves[:half], "fp32")))]
    for i in range(n_random):
        default = rng.choice(PRECS)
        targets = rng.sample(leaves, max(1, min(len(leaves), rng.randint(2, 6))))
        out.append((f"random {i + 1}", Policy(default=default, layers={
            p: rng.choice(PRECS) for p in targets})))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic) if len(a) >= 3 else float("nan")


def run_model(name: str, path: Path, profile: Any, args: argparse.Namespace,
              rng: random.Random) -> list[dict[str, Any]]:
    spec = load_model_file(path)
    net = spec.model()
    batch = spec.calibration_batches()[0]
    graph = trace(net, batch, forward=spec.forward, model_name=spec.name)
    cm = CostModel(graph, profile, mode="compile")  # the profile carries the per-call overhead
    todo = plans(net, args.random, rng)
    if args.smoke:
        todo = todo[:2]
    rows = []
    for label, pol in todo:
        est = cm.estimate(pol)
        priced = cm.breakdown(pol).kernels
        # bytes of the fused kernels (everything but GEMMs / SDPA, which carry FLOPs)
        priced_bytes = sum(k.bytes for _, k in cm.kernels(pol) if not k.flops)
        codes: list[str] = []
        t0 = time.monotonic()
        with torch.no_grad(), apply_policy(net, pol, target="cpu"):
            compiled, counts, generated = compile_and_count(
                net, lambda c: spec.forward(c, batch), codes)
            secs = time.monotonic() - t0
            t = timed(lambda c=compiled: spec.forward(c, batch), 3, args.repeats)
        rows.append({"model": name, "plan": label, "priced_kernels": priced,
                     "priced_fused_mb": priced_bytes / 1e6,
                     "generated_fused_mb": sum(fused_bytes(c) for c in codes) / 1e6,
                     "launched": sum(counts.values()), "fused": counts["fused"],
                     "extern": counts["extern"] + counts["fallback"],
                     "generated_kernel_count": generated, "est_us": est * 1e6,
                     "measured_us": t * 1e6, "compile_s": secs})
        r = rows[-1]
        print(f"  {name:14s} {label:24s} kernels priced {priced:4d} launched "
              f"{r['launched']:4d}  est {r['est_us']:9.1f} us  measured {r['measured_us']:9.1f}"
              f" us  (compile {secs:.0f} s)", file=sys.stderr, flush=True)
    torch._dynamo.reset()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--random", type=int, default=1, help="random plans per model")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", PolicyWarning)
    torch.set_num_threads(1)
    names = ["mixed8"] if args.smoke else [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    base = get_profile("cpu")
    started = time.monotonic()
    cal = calibrate(base, 5 if args.smoke else args.repeats, args.smoke)
    profile = cal.profile
    print(f"calibrated on compiled micro-benchmarks: rel. RMSE {cal.calibration.rel_rmse:.2f}; "
          f"per compiled call {profile.call_overhead_s * 1e6:.1f} us; launch {profile.launch_overhead_s * 1e6:.1f} us, mem "
          f"{profile.bandwidth / 1e9:.1f} GB/s, fp32 {profile.peak('fp32') / 1e12:.2f} TF, "
          f"bf16 {profile.peak('bf16') / 1e12:.2f} TF, fp16 {profile.peak('fp16') / 1e12:.2f} TF")
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    for name in names:
        rows += run_model(name, MODELS[name], profile, args, rng)
    print()
    print("| model | plan | kernels priced | launched (fused + extern) | "
          "generated_kernel_count | fused MB priced | fused MB in the code | est. µs | "
          "measured µs | est/meas |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['plan']} | {r['priced_kernels']} | {r['launched']} "
              f"({r['fused']} + {r['extern']}) | {r['generated_kernel_count']} | "
              f"{r['priced_fused_mb']:.2f} | {r['generated_fused_mb']:.2f} | "
              f"{r['est_us']:.0f} | {r['measured_us']:.0f} | "
              f"{r['est_us'] / r['measured_us']:.2f} |")
    print()
    print("| models | plans | kernels exact | kernel count error (median, worst) | "
          "fused bytes error (median, worst) | Spearman (time) | time error median | worst |")
    print("|---|---|---|---|---|---|---|---|")
    groups = [("all", rows)] + [(m, [r for r in rows if r["model"] == m]) for m in names]
    for g, rs in groups:
        if not rs:
            continue
        kerr = sorted(abs(r["priced_kernels"] - r["launched"]) / r["launched"] for r in rs)
        terr = sorted(abs(r["est_us"] - r["measured_us"]) / r["measured_us"] for r in rs)
        berr = sorted(abs(r["priced_fused_mb"] - r["generated_fused_mb"])
                      / max(r["generated_fused_mb"], 1e-9) for r in rs)
        exact = sum(r["priced_kernels"] == r["launched"] for r in rs)
        rho = spearman([r["est_us"] for r in rs], [r["measured_us"] for r in rs])
        print(f"| {g} | {len(rs)} | {exact}/{len(rs)} | {_median(kerr):.0%}, {kerr[-1]:.0%} | "
              f"{_median(berr):.0%}, {berr[-1]:.0%} | {rho:.2f} | {_median(terr):.0%} | "
              f"{terr[-1]:.0%} |")
    print(f"\n({time.monotonic() - started:.0f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread)")
    return 0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return math.nan if not n else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


if __name__ == "__main__":
    sys.exit(main())
