"""Tune for a B200 with block-scaled formats in the search, and set the tuned
plan beside the uniform choices a user has, all priced by the same cost model.

For each model: ``tune(target="b200")`` over fp32/tf32/bf16/fp16/fp8/mxfp8/nvfp4, then, on
the same eval data and the same whole-forward pricing (``autoprec/cost/model.py``, the
``b200`` profile of ``autoprec/cost/devices.yaml`` with each format's quantisation passes):

- one global bf16 autocast (``default: bf16``);
- fp8 / mxfp8 / nvfp4 everywhere: ``default: bf16`` with that format on every Linear
  eligible for it.

The tuned policy is applied here on the CPU (emulated formats, MXFP8 with NVIDIA's rceil
scales) and audited on a real forward: every Linear must compute in the format its rule
gives. Errors are measured (relative L2 of the outputs on the eval data); speed-ups are
estimates over all-fp32 on the B200.

Run: ``.venv/bin/python -m benchmarks.b200_formats`` (about 2 minutes on 2 cores; probes
are cached under ``policies/.autoprec/probe-cache``). Writes
``benchmarks/results/b200_formats.md``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.plan import assignment
from autoprec.policy import Policy, PolicyWarning, gemm_leaf_paths
from autoprec.policy.modules import format_eligible
from autoprec.trace import trace
from autoprec.tuning.tune import tune
from autoprec.workload.loading import load_model_file
from autoprec.workload.scoring import reference, score
from benchmarks.common import RESULTS, example

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: model, deployment batch, budgets
RUNS = [("wide", 32768, (0.05, 0.01)), ("minilm", 1024, (0.03,))]


@dataclass
class Ctx:
    """One model of the benchmark: what a row needs."""

    name: str
    spec: Any
    net: torch.nn.Module
    evalb: list[Any]
    ref: Any
    cost: CostModel


def row(ctx: Ctx, label: str, pol: Policy, budget: float, err: float | None = None) -> str:
    """One table row: the plan's eval error (measured here unless given) and its price."""
    if err is None:
        with apply_policy(ctx.net, pol, target="b200"):
            err = score(ctx.spec, ctx.net, ctx.evalb, ctx.ref, "of eval_data").error
    bd = ctx.cost.breakdown(pol)
    counts: dict[str, int] = {}
    for prec in assignment(pol, ctx.net).values():  # every GEMM leaf
        counts[prec] = counts.get(prec, 0) + 1
    mix = " ".join(f"{k}x{v}" for k, v in sorted(counts.items()))
    within = "" if err <= budget else " (over budget)"
    return (f"| {ctx.name} | {budget:g} | {label} | {err:.4g}{within} "
            f"| {ctx.cost.speedup(pol):.2f}x | {bd.casts + bd.weight_casts} | {mix} |")


def everywhere(fmt: str, net: torch.nn.Module) -> Policy:
    leaves = [p for p in gemm_leaf_paths(net) if format_eligible(net.get_submodule(p), fmt)]
    return Policy(default="bf16", layers=dict.fromkeys(leaves, fmt))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "b200_formats.md")
    ap.add_argument("--models", default=None, help="comma list (default: wide,minilm)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", PolicyWarning)
    started = time.monotonic()
    profile = get_profile("b200")
    lines = ["| model | budget | plan | held-out error | est. speed-up on b200 (whole forward) "
             "| casts | formats |", "|---|---|---|---|---|---|---|"]
    audits = []
    wanted = args.models.split(",") if args.models else None
    for name, bs, budgets in RUNS:
        if wanted and name not in wanted:
            continue
        spec = load_model_file(example(name))
        net = spec.model()
        calib, evalb = spec.calibration_batches(), spec.eval_batches()
        graph = trace(net, calib[0], forward=spec.forward, model_name=name)
        cost = CostModel(graph, profile, batch_size=bs)
        ref = reference(spec, net, evalb, "of eval_data")

        ctx = Ctx(name, spec, net, evalb, ref, cost)
        for budget in budgets:
            out = ROOT / "policies" / f"{name}-b200-err{budget:g}.yaml"
            r = tune(spec, max_error=budget, target="b200", batch_size=bs, out=out,
                     storage="memory", tracker=None, progress=False,
                     cache_dir=ROOT / "policies" / ".autoprec" / "probe-cache")
            lines.append(row(ctx, f"**tuned** ({'feasible' if r.feasible else 'NOT feasible'}, "
                             f"{r.search.evaluations:.1f} evals)", r.policy, budget,
                             r.plan.eval_error))
            lines.append(row(ctx, "one global autocast bf16", Policy(default="bf16"), budget))
            for fmt in ("fp8", "mxfp8", "nvfp4"):
                lines.append(row(ctx, f"{fmt} everywhere", everywhere(fmt, net), budget))
            with apply_policy(net, r.policy, target="b200") as h, torch.no_grad():
                rep = h.audit(lambda: spec.forward(net, calib[0]), strict=False)  # noqa: B023
            ran = {x.computed for x in rep.rows if x.computed != "-"}
            audits.append(f"- {name} @ {budget:g}: `{out.relative_to(ROOT)}` applied on this CPU "
                          f"(emulated formats): audit {'ok' if rep.ok else 'FAILED'}, GEMMs "
                          f"computed in {', '.join(sorted(ran))}; {rep.casts} casts ran")
            print(lines[-5:], audits[-1], flush=True)
    text = "\n\n".join([
        "# Block-scaled formats: a tune for a B200 against the uniform choices",
        f"Generated by `.venv/bin/python -m benchmarks.b200_formats` "
        f"({time.monotonic() - started:.0f} s on this machine's CPUs).",
        __doc__.split("\n\n")[1], "\n".join(lines), "\n".join(audits)]) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
