"""Eager vs compiled deployment: does tuning for ``torch.compile`` pick another plan, and is
each winner the fastest in its own mode here?

For each model: the CPU profile is calibrated twice on this machine, as ``autoprec tune
--target cpu`` calibrates it (``pricing.speed_source.calibrate_here``: single GEMMs per
precision, a copy, a tiny add — eager, and ``torch.compile``'d with the compiled call's
own time fitted) — then ``tune(..., target="cpu")`` runs once per mode (``compile=True`` prices plans as inductor runs them),
each with its mode's calibrated profile, as a user runs it: its last step times the plan
beside the baselines on this CPU (compiled, for the compile tune) and writes the fastest
measured (the last column). The two winners and the baselines (all-fp32, one
autocast bf16 region) are then run here in both modes (eager; ``torch.compile`` after
``apply_policy``, one model copy per plan) and timed interleaved (one thread, the thread's
CPU time; every round runs all 8 in a fresh order; ratios are medians of per-round
ratios, which cancel the shared machine's drifting load). Printed per
model: each plan's estimate and measured latency in both modes, the compiled winner's
measured speed-up over the faster compiled baseline, and its estimated vs measured
speed-up over compiled fp32.

    python -m benchmarks.compile_winners       # mixed8, wide, minilm, compile_mix
    python -m benchmarks.compile_winners --models mixed8 --trials 20
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.policy import Policy, PolicyWarning
from autoprec.pricing.speed_source import calibrate_here
from autoprec.trace import trace
from autoprec.tuning.tune import tune
from autoprec.workload.loading import load_model_file
from autoprec.workload.scoring import reference, score
from benchmarks import compile_cost
from benchmarks.common import example

MODELS = {"mixed8": example("mixed8"), "wide": example("wide"),
          "minilm": example("minilm"),
          "compile_mix": example("compile_mix")}


def interleaved(runs: dict[str, Any], rounds: int, inner: int, seed: int = 0
                ) -> dict[str, list[float]]:
    """Thread CPU seconds per run of every entry, one sample (mean of ``inner`` runs) per
    round, the entries in a fresh random order each round: a shared 2-vCPU machine's load
    (an SMT sibling busy doubles a thread's CPU time) drifts over minutes, and the ratios
    of one round cancel it."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        for _ in range(2):
            run()  # warm-up
    for _ in range(rounds):
        names = list(runs)
        rng.shuffle(names)
        for n in names:
            t0 = time.thread_time()
            for _ in range(inner):
                runs[n]()
            out[n].append((time.thread_time() - t0) / inner)
    return out


def ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of a's time / b's time."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


def fmt_pol(p: Policy) -> str:
    rules = ", ".join(f"{k}: {v}" for k, v in p.layers.items())
    return f"default {p.default}" + (f" + {{{rules}}}" if rules else "")


def run_model(name: str, profiles: dict[str, Any], args: argparse.Namespace,
              out_dir: Path) -> dict[str, Any]:
    spec = load_model_file(MODELS[name])
    winners: dict[str, Policy] = {}
    printed: dict[str, float] = {}
    tune_measured: dict[str, str] = {}
    for mode in ("eager", "compile"):
        t0 = time.monotonic()
        # as a user runs it: the search, then the last step times the rows on this CPU
        # (compiled, one model copy per plan, for the compile tune) and writes the fastest
        r = tune(MODELS[name], target="cpu", max_error=args.max_error, trials=args.trials,
                 out=out_dir / f"{name}-{mode}.yaml", progress=False,
                 compile=mode == "compile", profile=profiles[mode],
                 cache_dir=out_dir / "cache")
        winners[mode] = r.policy
        printed[mode] = r.est_speedup
        w = r.plan.speed.winner if r.plan.speed is not None else None
        tune_measured[mode] = ("-" if w is None or w.speedup is None else
                               f"{w.name}: {w.speedup:.2f}x ({w.p10:.2f}-{w.p90:.2f})")
        print(f"  {name}: tuned for {mode} in {time.monotonic() - t0:.0f} s: "
              f"{fmt_pol(r.policy)} (est. {r.est_speedup:.2f}x, error {r.plan.eval_error:.3g}; "
              f"tune measured {tune_measured[mode]})", file=sys.stderr, flush=True)
        if r.plan.speed is not None:
            print(r.plan.speed.table(), file=sys.stderr, flush=True)
    net = spec.model()
    batch = spec.calibration_batches()[0]
    graph = trace(net, batch, forward=spec.forward, model_name=spec.name)
    models = {"eager": CostModel(graph, profiles["eager"]),
              "compile": CostModel(graph, profiles["compile"], mode="compile")}
    plans = {"eager winner": winners["eager"], "compiled winner": winners["compile"],
             "fp32": Policy(default="fp32"), "autocast bf16": Policy(default="bf16")}
    eval_batches = spec.eval_batches()
    ref = reference(spec, net, eval_batches, "of eval_data", need_outputs=True)
    rows = []
    handles, runs = [], {}
    torch._dynamo.reset()
    for label, pol in plans.items():
        pol = Policy(default=pol.default, layers=dict(pol.layers))  # the rules only
        with torch.no_grad(), apply_policy(net, pol, target="cpu"):
            err = score(spec, net, eval_batches, ref, "of eval_data").error
        rows.append({"plan": label, "policy": fmt_pol(pol), "error": err,
                     "feasible": err <= args.max_error,
                     **{f"est_{m}": models[m].estimate(pol) for m in ("eager", "compile")}})
        # one copy of the model per plan, the policy applied for the whole measurement
        mine = copy.deepcopy(net)
        handles.append(apply_policy(mine, pol, target="cpu"))
        with torch.no_grad():
            compiled, _, _ = compile_cost.compile_and_count(mine, lambda c: spec.forward(c, batch))
        runs[(label, "eager")] = lambda m=mine: spec.forward(m, batch)
        runs[(label, "compile")] = lambda c=compiled: spec.forward(c, batch)
    with torch.no_grad():
        samples = interleaved(runs, args.rounds, args.inner)
    for h in handles:
        h.remove()
    for row in rows:
        for mode in ("eager", "compile"):
            row[f"meas_{mode}"] = statistics.median(samples[(row["plan"], mode)])
            row[f"ratio_{mode}"] = ratio(samples, (row["plan"], mode), ("fp32", mode))
        print(f"    {row['plan']:16s} eager est {row['est_eager'] * 1e3:8.2f} ms meas "
              f"{row['meas_eager'] * 1e3:8.2f} ms | compiled est "
              f"{row['est_compile'] * 1e3:8.2f} ms meas {row['meas_compile'] * 1e3:8.2f} ms",
              file=sys.stderr, flush=True)
    samples_by = {f"{k[0]}|{k[1]}": v for k, v in samples.items()}
    winners_ratio = {m: ratio(samples, ("eager winner", m), ("compiled winner", m))
                     for m in ("eager", "compile")}
    torch._dynamo.reset()
    return {"model": name, "rows": rows, "printed": printed, "samples": samples_by,
            "tune_measured": tune_measured,
            "winners_ratio": winners_ratio, "same": winners["eager"].layers ==
            winners["compile"].layers and winners["eager"].default == winners["compile"].default}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--max-error", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    ap.add_argument("--inner", type=int, default=3, help="forwards per timed sample")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", PolicyWarning)
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(1)
    started = time.monotonic()
    base = get_profile("cpu")
    eager_cal = calibrate_here(base, "cpu", mode="eager")
    compile_cal = calibrate_here(base, "cpu", mode="compile")
    profiles = {"eager": eager_cal.profile, "compile": compile_cal.profile}
    for mode, cal in (("eager", eager_cal), ("compile", compile_cal)):
        p = cal.profile
        print(f"{mode} calibration: rel. RMSE {cal.calibration.rel_rmse:.2f}; launch "
              f"{p.launch_overhead_s * 1e6:.1f} us, mem {p.bandwidth / 1e9:.1f} GB/s, fp32 "
              f"{p.peak('fp32') / 1e12:.2f} TF, bf16 {p.peak('bf16') / 1e12:.2f} TF")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in [m for m in args.models.split(",") if m]:
            results.append(run_model(name, profiles, args, Path(tmp)))
    print()
    print("| model | plan | policy | error (eval) | eager est. ms | eager measured ms | "
          "compiled est. ms | compiled measured ms |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {res['model']} | {r['plan']} | {r['policy']} | {r['error']:.3g}"
                  f"{'' if r['feasible'] else ' (over budget)'} | {r['est_eager'] * 1e3:.2f} "
                  f"| {r['meas_eager'] * 1e3:.2f} | {r['est_compile'] * 1e3:.2f} | "
                  f"{r['meas_compile'] * 1e3:.2f} |")
    print()
    print("| model | winners differ | eager winner: eager / compiled winner: eager (measured) "
          "| compiled winner: compiled / eager winner: compiled (measured) | compiled winner "
          "/ faster compiled baseline within budget | est. vs measured speed-up over compiled fp32 | "
          "tune's printed est. | tune's own compiled timing (written plan) |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        rows = {r["plan"]: r for r in res["rows"]}
        cw = rows["compiled winner"]
        in_e = res["winners_ratio"]["eager"]  # < 1: the eager winner is faster eager
        in_c = 1.0 / res["winners_ratio"]["compile"]  # < 1: the compiled one, compiled
        # per-round ratios to compiled fp32: speed-up = 1 / ratio
        meas_sp = 1.0 / cw["ratio_compile"]
        bf16 = rows["autocast bf16"]
        best_base = max(1.0, 1.0 / bf16["ratio_compile"]) if bf16["feasible"] else 1.0
        base_c = meas_sp / best_base  # over the faster of fp32 / autocast bf16 within budget
        est_sp = rows["fp32"]["est_compile"] / cw["est_compile"]
        print(f"| {res['model']} | {'no' if res['same'] else 'yes'} | "
              f"{in_e:.2f} | {in_c:.2f} | "
              f"{base_c:.2f}x | {est_sp:.2f}x vs {meas_sp:.2f}x "
              f"({(est_sp - meas_sp) / meas_sp:+.0%}) | {res['printed']['compile']:.2f}x "
              f"({(res['printed']['compile'] - meas_sp) / meas_sp:+.0%}) | "
              f"{res['tune_measured']['compile']} |")
    print(f"\n({time.monotonic() - started:.0f} s; torch {torch.__version__}, 1 thread, "
          f"{args.trials} trials per tune, max error {args.max_error:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
