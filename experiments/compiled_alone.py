"""Compiled plans timed alone, back to back, beside their estimates (issue 29).

tune's timing step interleaves its rows round by round; this times each plan on its own
(20 forwards after 3 warm-ups, one torch thread, thread CPU time) right after pricing it
with the cost model tune uses (this machine's calibration and op timings, cached under
``--cache``), so a row's spread between runs can be told from the estimate's error. Rows:

- ``fp32``: no rule; ``bf16 deploy``: ``model.to(bf16)`` (the deploy form's
  ``default: bf16``); ``bf16 autocast (apply)``: one global autocast as autoprec applies it
  (the training form's ``default: bf16``, torch.nn's fused fast paths off so the rule runs);
- ``bf16 autocast (plain)``: a user's own ``with torch.autocast("cpu", bfloat16)`` around
  the compiled model, fast paths as torch leaves them (no estimate: not a plan autoprec
  writes).

    python experiments/compiled_alone.py                      # minilm, nn_transformer
    python experiments/compiled_alone.py --models nn_transformer
    python experiments/compiled_alone.py --models minilm --profile   # + where the time goes

``--profile`` adds, per model, fp32 and ``model.to(bf16)``'s estimate split into GEMMs
(convolutions included), SDPA, the fused kernels and the program's per-call overhead
(``CostModel`` parts, per-op timings, the calibrated ``call_overhead_s``) beside a
torch.profiler run of 10 compiled forwards split the same way (a GEMM's ``aten::copy_``,
its bias broadcast into the output, counted with it, as its op timing does; inductor's
kernel profiling on, so that each fused C++ kernel is an event; the rest is overhead: the
compiled wrapper's Python, dynamo's guards, dispatch) and the forward timed without the
profiler.

Timings are this machine's (its CPU is printed); ratios within one run only.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprec.apply.apply import apply_policy  # noqa: E402
from autoprec.capability import cpu_facts  # noqa: E402
from autoprec.evaluation.speed_source import speed_source  # noqa: E402
from autoprec.loading import load_model_file  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.trace import trace  # noqa: E402

PLANS = {"fp32": Policy(default="fp32", form="deploy"),
         "bf16 deploy": Policy(default="bf16", form="deploy"),
         "bf16 autocast (apply)": Policy(default="bf16", form="train"),
         "bf16 autocast (plain)": None}


def seconds(fn: Any, n: int = 20) -> float:
    for _ in range(3):
        fn()
    t = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t) / n


def rows_of(name: str, cache: Path) -> list[tuple[str, float | None, float]]:
    spec = load_model_file(ROOT / "experiments" / name / "model.py")
    batch = spec.calibration_batches()[0]
    graph = trace(spec.model(), batch, forward=spec.forward)
    src = speed_source("cpu", measure=True, cache_dir=cache, mode="compile")
    out = []
    for label, pol in PLANS.items():
        model = spec.model()
        handle = apply_policy(model, pol) if pol is not None else None
        compiled = torch.compile(model)

        def run(c: Any = compiled, plain: bool = pol is None) -> Any:
            with torch.no_grad():
                if plain:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        return spec.forward(c, batch)
                return spec.forward(c, batch)

        est = (src.cost_model(graph, graph.batch_size, "compile", form=pol.form)
               .estimate(pol) if pol is not None else None)
        out.append((label, est, seconds(run)))
        if handle is not None:
            handle.remove()
        torch._dynamo.reset()
    return out


_GEMM_EVENTS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::copy_",
                "aten::mkldnn_convolution", "aten::convolution", "aten::_convolution")


def _kind(key: str) -> str:
    """gemm / sdpa / fused (an inductor C++ kernel, named with kernel profiling on) /
    overhead (the rest: the compiled wrapper's Python, dynamo's guards, dispatch)."""
    if key in _GEMM_EVENTS:
        return "gemm"
    if "scaled_dot" in key:
        return "sdpa"
    return "fused" if "cpp_fused" in key else "overhead"


def profile_rows(name: str, cache: Path) -> list[str]:
    """Where compiled fp32 and ``model.to(bf16)`` spend their time: estimated vs profiled."""
    from torch.profiler import ProfilerActivity, profile

    from autoprec.cost.compiled import _is_extern

    spec = load_model_file(ROOT / "experiments" / name / "model.py")
    batch = spec.calibration_batches()[0]
    graph = trace(spec.model(), batch, forward=spec.forward)
    src = speed_source("cpu", measure=True, cache_dir=cache, mode="compile")
    out = []
    for label in ("fp32", "bf16"):
        pol = Policy(default=label, form="deploy")
        cost = src.cost_model(graph, graph.batch_size, "compile", form="deploy")
        sch = cost.schedule(pol)
        est = {"gemm": 0.0, "sdpa": 0.0}
        for i, op in enumerate(graph.ops.ops):
            if _is_extern(op):
                sec = cost._op_seconds(i, sch, sch.compute[i])
                kind = "sdpa" if op.kind == "attention" or "scaled" in op.name else "gemm"
                est[kind] += float(sec[0]) if sec is not None else float("nan")
        model = spec.model()
        handle = apply_policy(model, pol)
        compiled = torch.compile(model)

        def run(c: Any = compiled) -> Any:
            with torch.no_grad():
                return spec.forward(c, batch)

        measured = seconds(run)
        # a second program with inductor's kernel profiling on: each fused kernel an event
        with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
            torch._dynamo.reset()
            kp = torch.compile(model)
            run(kp)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    run(kp)
        got = {"gemm": 0.0, "sdpa": 0.0, "fused": 0.0, "overhead": 0.0}
        for e in prof.key_averages():
            got[_kind(e.key)] += e.self_cpu_time_total / 10 / 1e6
        bd = cost.breakdown(pol)
        call = cost.call_overhead_s
        ms = [1e3 * x for x in (est["gemm"], got["gemm"], est["sdpa"], got["sdpa"],
                                bd.parts["other"] - call, got["fused"], call, got["overhead"],
                                bd.total_s, measured)]
        out.append(f"| {name} | {label} | " + " | ".join(f"{x:.2f}" for x in ms) + " |")
        handle.remove()
        torch._dynamo.reset()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="minilm,nn_transformer")
    ap.add_argument("--cache", type=Path, default=Path(".autoprec_cache") / "compiled_alone")
    ap.add_argument("--profile", action="store_true",
                    help="also split fp32 and model.to(bf16) into GEMMs, SDPA and the rest, "
                         "estimated vs profiled")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in names:
        if not (ROOT / "experiments" / name / "model.py").is_file():
            ap.error(f"--models: no experiments/{name}/model.py")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"machine: {cpu_facts()}; torch {torch.__version__}; 1 thread, thread CPU time\n")
    print("| model | plan | est. ms | measured ms | est. x | measured x |")
    print("|---|---|---|---|---|---|")
    for name in names:
        rows = rows_of(name, args.cache)
        est32, meas32 = rows[0][1], rows[0][2]
        for label, est, meas in rows:
            e = "-" if est is None else f"{est * 1e3:.2f}"
            ex = "-" if est is None or est32 is None else f"{est32 / est:.2f}x"
            print(f"| {name} | {label} | {e} | {meas * 1e3:.2f} | {ex} | {meas32 / meas:.2f}x |")
    if args.profile:
        print("\n| model | plan | GEMMs est. ms | profiled | SDPA est. | profiled "
              "| fused est. | profiled | program overhead est. | profiled | total est. "
              "| measured |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name in names:
            for row in profile_rows(name, args.cache):
                print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
