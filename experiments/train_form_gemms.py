"""The training form's 16-bit GEMMs: priced cold (as stored) or hot (as just cast)? (issue 29)

Under one global bf16 autocast every GEMM reads the bf16 cast of its fp32 master that
autocast wrote right before it: replayed alone in model order (experiments/weight_reads.py)
such a GEMM runs nearly as fast as with its weight hot in cache. The estimate prices it at
the stored weight's cold timing instead (``autoprec/cost/op_measure.py``). This checks the
choice end to end: per model, tune's interleaved timing (``evaluation.timing``: one torch
thread, thread CPU time, median of per-round ratios to fp32) of fp32, one global bf16
autocast and ``model.to(bf16)``, beside the estimate as priced, and the autocast row priced
the other way: its 16-bit GEMMs at timings with every operand hot (the op timings measured
a second time with ``op_measure._span`` at 0).

    python experiments/train_form_gemms.py                       # eager, six models
    python experiments/train_form_gemms.py --mode compile --models mixed8,encoder4

Timings are this machine's (its CPU is printed); compare within one table only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprec.capability import cpu_facts  # noqa: E402
from autoprec.cost import op_measure  # noqa: E402
from autoprec.cost.compiled import make_cost_model  # noqa: E402
from autoprec.cost.machine import timing_threads  # noqa: E402
from autoprec.evaluation.speed_source import speed_source  # noqa: E402
from autoprec.evaluation.timing import compiled_timer, interleaved_timer  # noqa: E402
from autoprec.fused import fused_paths_off  # noqa: E402
from autoprec.loading import load_model_file  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.trace import trace  # noqa: E402

MODELS = "minilm,mixed8,encoder4,nn_transformer,trap,compile_mix"
ROWS = {"fp32": Policy(default="fp32", form="deploy"),
        "autocast": Policy(default="bf16"),
        "deploy": Policy(default="bf16", form="deploy")}


def hot_gemms(cold: Any, hot: Any, graph: Any) -> Any:
    """``cold``'s op timings with every 16-bit GEMM / SDPA reading a parameter taken from
    ``hot``: what the autocast row costs if its GEMMs read their just-cast weights hot."""
    vals, ops = graph.ops.values, graph.ops.ops
    compute = {i: dict(t) for i, t in cold.compute.items()}
    for i, t in hot.compute.items():
        if i in compute and any(vals[v].source == "param" for v in ops[i].inputs):
            compute[i].update({p: s for p, s in t.items() if p != "fp32"})
    return dataclasses.replace(cold, compute=compute)


def one(name: str, mode: str, cache: Path) -> dict[str, float]:
    spec = load_model_file(ROOT / "experiments" / name / "model.py")
    net = spec.model()
    batch = spec.calibration_batches()[0]
    graph = trace(net, batch, forward=spec.forward)
    prof = speed_source("cpu", measure=True, cache_dir=cache, mode=mode).profile
    bs = graph.batch_size
    with timing_threads("cpu"):
        cold = op_measure.measure(graph.ops, bs)
        span = op_measure._span
        op_measure._span = lambda footprint: 0  # every operand hot
        try:
            hot = op_measure.measure(graph.ops, bs)
        finally:
            op_measure._span = span

    def est(pol: Policy, times: Any) -> float:
        return make_cost_model(graph, prof, bs, mode, op_times=times,
                               form=pol.form).speedup(pol)

    out = {f"est {k}": est(p, cold) for k, p in ROWS.items() if k != "fp32"}
    out["est autocast, GEMMs hot"] = est(ROWS["autocast"], hot_gemms(cold, hot, graph))
    if mode == "compile":
        timer = compiled_timer(net, spec.forward, batch, "cpu", "cpu")
    else:
        def run() -> Any:
            with torch.no_grad(), fused_paths_off():
                return spec.forward(net, batch)

        timer = interleaved_timer(net, run, "cpu", "cpu")
    s = {k: np.asarray(v) for k, v in timer(ROWS).items()}
    for k in ("autocast", "deploy"):
        out[f"meas {k}"] = float(np.median(s["fp32"] / s[k]))
    out["rounds"] = len(s["fp32"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if not (ROOT / "experiments" / m / "model.py").is_file()]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}: no experiments/{unknown[0]}/model.py")
    warnings.filterwarnings("ignore")
    print(f"machine: {cpu_facts()}; torch {torch.__version__}; one torch thread; "
          f"{args.mode}; 1-minute load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| model | rounds | `model.to(bf16)`: est. / measured | one bf16 autocast: measured "
          "| est., GEMMs cold (priced so) | est., GEMMs hot |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = one(name, args.mode, Path(tmp) / "calibration")
            m = r["meas autocast"]
            print(f"| {name} | {r['rounds']:.0f} | {r['est deploy']:.2f}x / "
                  f"{r['meas deploy']:.2f}x ({r['est deploy'] / r['meas deploy'] - 1:+.0%}) | "
                  f"{m:.2f}x | {r['est autocast']:.2f}x ({r['est autocast'] / m - 1:+.0%}) | "
                  f"{r['est autocast, GEMMs hot']:.2f}x "
                  f"({r['est autocast, GEMMs hot'] / m - 1:+.0%}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
