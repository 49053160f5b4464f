"""Tune every experiment model for its budgets and targets: the results table (issue 10).

For each model x target x budget below, ``autoprec.search.tune.tune`` finds a per-layer
policy at a deployment batch size where lowering matters on a GPU, and the policy is
written to ``policies/<model>-<target>[-<budget>].yaml`` (the budget tag when the model is
tuned for several budgets). Each row compares it with the **best uniform precision that
meets the same budget**: tf32 / bf16 / fp16 on every GEMM node that may take it (what
``torch.autocast`` around the whole model gives), fp8 on every fp8-eligible GEMM leaf with
the rest in fp32, each scored on the eval data (as the tuned policy is confirmed there)
and priced by the same cost model at the same batch size; "none" when no uniform
precision the target runs is within budget.

Speed-ups are estimates (roofline + casts on the target's datasheet profile, over all-fp32
on that target); errors are measured here on the CPU with the real low-precision
arithmetic (fp8 emulated). ``held-out`` is the tuned policy's error (relative L2 of the
outputs) or metric drop on the eval data; ``tuning s`` is wall time on this (shared, 2-core)
machine and includes the probes when they were not cached (``probes`` column: probes are
cached under ``policies/.autoprec/probe-cache`` per model, data, precisions and budget,
so other targets of a model and later runs reuse them). Studies are in memory: a rerun
starts afresh and, with the same seed, finds the same policies.

Run: ``.venv/bin/python experiments/run_all.py`` (5-7 minutes measured on 2 loaded cores
with no probes cached, less with them cached), ``--quick`` (a 1-3 minute subset, written
under ``experiments/results/quick/``) or ``--models trap,gpt``. Writes
``experiments/results/results.md``, ``results.csv`` and ``speedup.png``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.evaluate import Score, reference, score
from autoprec.loading import ModelSpec, load_model_file
from autoprec.metrics import batch_size_of
from autoprec.policy import Policy, assignment, gemm_leaf_paths
from autoprec.policy.resolve import fp8_eligible
from autoprec.precisions import PRECISIONS
from autoprec.search.tune import TuneResult, tune
from autoprec.trace import trace
from autoprec.trace.graph import LayerGraph

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Model:
    name: str
    batch_size: int  # deployment batch size the speed-ups are priced at
    batch_note: str  # what that batch is, for the table

    @property
    def path(self) -> Path:
        return HERE / self.name / "model.py"


# Deployment batch sizes: large enough that the GEMMs are past launch-bound on an H100 (a
# calibration-sized batch prices every precision alike, DESIGN.md), ~16k tokens for the
# transformers.
MODELS = {
    "trap": Model("trap", 65536, "65536 rows"),
    # Sentences are ~15 tokens: 1024 of them are ~15k tokens, as the other transformers.
    "minilm": Model("minilm", 1024, "1024 sentences"),
    "digits_cnn": Model("digits_cnn", 4096, "4096 images"),
    "gpt": Model("gpt", 256, "256 seq x 64 tok"),
    "vit": Model("vit", 256, "256 images x 65 tok"),
}


@dataclass(frozen=True)
class Run:
    model: str
    target: str
    kind: str  # "max_error" (relative L2 of the outputs) or "max_drop" (metric drop)
    budget: float

    @property
    def budget_text(self) -> str:
        return f"{'error' if self.kind == 'max_error' else 'drop'} <= {self.budget:g}"

    @property
    def tag(self) -> str:
        return f"{'err' if self.kind == 'max_error' else 'drop'}{self.budget:g}"


E, D = "max_error", "max_drop"
RUNS = [
    # trap: no uniform low precision meets 1%; a100 has no fp8, t4 only fp16.
    Run("trap", "h100", E, 0.01), Run("trap", "h100", E, 0.05),
    Run("trap", "a100", E, 0.01), Run("trap", "t4", E, 0.01),
    # minilm: the embeddings within 1% (relative L2), or not one retrieval lost.
    Run("minilm", "h100", E, 0.01), Run("minilm", "h100", D, 0.0),
    # digits_cnn: at most one test image in 450 lost (accuracy drop 0.005).
    Run("digits_cnn", "h100", D, 0.005),
    Run("gpt", "h100", E, 0.01), Run("gpt", "h100", E, 0.03),
    Run("gpt", "a100", E, 0.01), Run("gpt", "t4", E, 0.01),
    Run("vit", "h100", E, 0.01),
]
QUICK = [Run("trap", "h100", E, 0.01), Run("trap", "t4", E, 0.01),
         Run("digits_cnn", "h100", D, 0.005), Run("gpt", "h100", E, 0.03)]


def policy_path(run: Run, policies: Path) -> Path:
    several = len({(r.kind, r.budget) for r in RUNS if r.model == run.model}) > 1
    return policies / f"{run.model}-{run.target}{f'-{run.tag}' if several else ''}.yaml"


# -- the uniform baseline ----------------------------------------------------------------


@dataclass
class Uniform:
    """One uniform precision on one model: its eval-data score and its assignment."""

    precision: str
    score: Score
    assign: dict[str, str]  # GEMM node path -> precision (what the cost model prices)

    def value(self, kind: str) -> float:
        return self.score.value if kind == "max_drop" else self.score.error


@dataclass
class Loaded:
    """One model, loaded once: spec (passed to tune), net, graph, uniform scores."""

    model: Model
    spec: ModelSpec
    net: torch.nn.Module  # fp32, for resolving policies (never left lowered)
    graph: LayerGraph
    uniform: list[Uniform]
    seconds: float

    def gemm_assignment(self, policy: Policy) -> dict[str, str]:
        return assignment(policy, self.net, [n.path for n in self.graph.gemm_nodes])


def uniform_policy(precision: str, net: torch.nn.Module, graph: LayerGraph) -> Policy:
    """``precision`` on every GEMM node that may take it (fp8: eligible leaves), else fp32."""
    if precision == "fp8":
        paths = [p for p in gemm_leaf_paths(net) if fp8_eligible(net.get_submodule(p))]
    else:
        paths = [n.path for n in graph.gemm_nodes if precision in n.allowed]
    return Policy(default="fp32", layers=dict.fromkeys(paths, precision),
                  model={"name": graph.model_name, "fingerprint": graph.fingerprint},
                  source=f"<uniform {precision}>")


def load(model: Model) -> Loaded:
    t0 = time.monotonic()
    spec = load_model_file(model.path)
    net = spec.model()
    calib, eval_batches = spec.calibration_batches(), spec.eval_batches()
    graph = trace(net, calib[0], forward=spec.forward, model_name=spec.name)
    ref = reference(spec, net, eval_batches, "of eval_data")
    uniform = []
    for p in PRECISIONS[1:]:
        pol = uniform_policy(p, net, graph)
        with apply_policy(net, pol):
            s = score(spec, net, eval_batches, ref, "of eval_data")
        uniform.append(Uniform(p, s, assignment(pol, net, [n.path for n in graph.gemm_nodes])))
    return Loaded(model, spec, net, graph, uniform, time.monotonic() - t0)


def best_uniform(loaded: Loaded, run: Run) -> tuple[Uniform | None, float]:
    """The fastest uniform precision the target runs within the budget, and its speed-up;
    of equally fast ones (bf16 and fp16 often price the same), the more accurate."""
    profile = get_profile(run.target)
    cost = CostModel(loaded.graph, profile, loaded.model.batch_size)
    fits = [(round(cost.speedup(u.assign), 9), -u.value(run.kind), u) for u in loaded.uniform
            if profile.supports(u.precision)[0] and u.value(run.kind) <= run.budget]
    if not fits:
        return None, 0.0
    speedup, _, u = max(fits, key=lambda f: f[:2])
    return u, speedup


# -- one row -------------------------------------------------------------------------------


def run_one(loaded: Loaded, run: Run, args: argparse.Namespace) -> dict[str, Any]:
    out = policy_path(run, args.policies)
    cached_before = set(args.cache_dir.glob("*")) if args.cache_dir.exists() else set()
    r: TuneResult = tune(
        loaded.spec, max_error=run.budget if run.kind == E else None,
        max_drop=run.budget if run.kind == D else None, target=run.target,
        batch_size=loaded.model.batch_size, trials=args.trials, seed=args.seed, out=out,
        storage="memory", tracker=None, progress=False, cache_dir=args.cache_dir)
    probed = bool(set(args.cache_dir.glob("*")) - cached_before)
    uni, uni_speedup = best_uniform(loaded, run)
    counts = Counter(loaded.gemm_assignment(r.policy).values())
    return {
        "model": run.model, "target": run.target, "budget_kind": run.kind,
        "budget": run.budget, "batch_size": loaded.model.batch_size,
        "batch": loaded.model.batch_note, "tuned_speedup": round(r.est_speedup, 4),
        "uniform_best": uni.precision if uni else "none",
        "uniform_speedup": round(uni_speedup, 4) if uni else "",
        "eval_error": r.eval_error, "calib_error": r.error, "feasible": r.feasible,
        "seconds": round(r.seconds, 1), "probes": "ran" if probed else "cached",
        "trials": r.trials, "evaluations": round(r.evaluations, 2),
        "layers": " ".join(f"{p}x{counts[p]}" for p in reversed(PRECISIONS) if counts[p]),
        "policy": str(out.resolve().relative_to(ROOT)) if out.resolve().is_relative_to(ROOT)
        else str(out),
    }


# -- outputs -------------------------------------------------------------------------------


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| model | target | budget | batch | tuned est. speed-up | best uniform (speed-up) "
            "| held-out error / drop | feasible | tuning s | probes | trials | evaluations "
            "| policy |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        uni = ("none" if r["uniform_best"] == "none"
               else f"{r['uniform_best']} ({r['uniform_speedup']:.2f}x)")
        budget = f"{'error' if r['budget_kind'] == E else 'drop'} <= {r['budget']:g}"
        lines.append(
            f"| {r['model']} | {r['target']} | {budget} | {r['batch']} "
            f"| **{r['tuned_speedup']:.2f}x** | {uni} | {_num(r['eval_error'])} "
            f"| {'yes' if r['feasible'] else 'NO'} | {r['seconds']:.0f} | {r['probes']} "
            f"| {r['trials']} | {r['evaluations']:.1f} | `{r['policy']}` |")
    return "\n".join(lines)


def uniform_table(models: list[Loaded]) -> str:
    """Every uniform precision per model: eval-data error (and drop), est. speed-up on h100."""
    lines = ["| model | precision | eval error (rel. L2) | metric drop | h100 est. speed-up |",
             "|---|---|---|---|---|"]
    for lo in models:
        cost = CostModel(lo.graph, get_profile("h100"), lo.model.batch_size)
        for u in lo.uniform:
            drop = "" if u.score.metric_drop is None else _num(u.value("max_drop"))
            lines.append(f"| {lo.model.name} | {u.precision} | {_num(u.score.error)} | {drop} "
                         f"| {cost.speedup(u.assign):.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: tuned vs best-uniform est. speed-up per row (no bar: no uniform fits)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = list(range(len(rows)))
    w = 0.38
    tuned = [r["tuned_speedup"] if r["feasible"] else 0.0 for r in rows]
    uni = [r["uniform_speedup"] or 0.0 for r in rows]
    ax.bar([i - w / 2 for i in x], tuned, w, label="tuned (autoprec)", color="#1f77b4")
    ax.bar([i + w / 2 for i in x], uni, w, label="best uniform within budget", color="#bbbbbb")
    for i, r in enumerate(rows):
        ax.annotate(f"{tuned[i]:.2f}", (i - w / 2, tuned[i]), ha="center", va="bottom",
                    fontsize=7)
        label = r["uniform_best"] if r["uniform_best"] == "none" else \
            f"{r['uniform_best']}\n{uni[i]:.2f}"
        ax.annotate(label, (i + w / 2, uni[i]), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="fp32")
    ax.set_xticks(x, [f"{r['model']}\n{r['target']}\n"
                      f"{'err' if r['budget_kind'] == E else 'drop'}<={r['budget']:g}"
                      for r in rows], fontsize=7)
    ax.set_ylabel("est. speed-up over fp32 (cost model)")
    ax.set_title("tuned policy vs best uniform precision meeting the same budget")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max([*tuned, *uni, 1.0]) * 1.2)
    fig.savefig(path, dpi=120)


def report(rows: list[dict[str, Any]], models: list[Loaded], args: argparse.Namespace,
           total: float) -> str:
    cmd = "experiments/run_all.py" + (" --quick" if args.quick else "") + (
        f" --models {args.models}" if args.models else "")
    doc = __doc__.split("\n\n")
    details = [f"- {r['model']} {r['target']} {r['budget_kind']} {r['budget']:g}: "
               f"{r['layers']} (calibration {_num(r['calib_error'])}, held-out "
               f"{_num(r['eval_error'])})" for r in rows]
    return "\n\n".join([
        "# autoprec results",
        f"Generated by `.venv/bin/python {cmd}` (seed {args.seed}, {args.trials} trials per "
        f"tune, {total:.0f} s on this machine's CPUs). Estimated speed-ups: the cost model on "
        "the target's datasheet profile (`autoprec/cost/devices.yaml`) at the deployment "
        "batch size, over all-fp32 on the same target.",
        "\n\n".join(doc[1:3]),
        markdown(rows),
        "![tuned vs best uniform](speedup.png)",
        "## Uniform precisions on the eval data\n\n" + uniform_table(models),
        "## Tuned policies: GEMM nodes per precision\n\n" + "\n".join(details),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a 2-4 minute subset, written under experiments/results/quick/")
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--trials", type=int, default=None, help="trials per tune (20; quick 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="results folder (experiments/results; quick: .../results/quick)")
    ap.add_argument("--policies", type=Path, default=None,
                    help="where tuned policies go (policies/; quick: OUT_DIR/policies)")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "policies" / ".autoprec" /
                    "probe-cache", help="probe cache shared by all runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # transformers' "Loading weights" bar, once per model load, would drown the log
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    args.trials = args.trials or (12 if args.quick else 20)
    args.out_dir = args.out_dir or HERE / "results" / ("quick" if args.quick else "")
    args.policies = args.policies or (args.out_dir / "policies" if args.quick
                                      else ROOT / "policies")
    runs = QUICK if args.quick else RUNS
    if args.models:
        wanted = args.models.split(",")
        unknown = [m for m in wanted if m not in MODELS]
        if unknown:
            ap.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
        runs = [r for r in runs if r.model in wanted]
    started = time.monotonic()

    rows: list[dict[str, Any]] = []
    models: list[Loaded] = []
    for name in dict.fromkeys(r.model for r in runs):
        lo = load(MODELS[name])
        models.append(lo)
        print(f"# {name}: {len(lo.graph.gemm_nodes)} GEMM nodes, calibration batch "
              f"{batch_size_of(lo.spec.calibration_batches()[0])}, deployment "
              f"{lo.model.batch_note}; uniform scored in {lo.seconds:.0f}s", flush=True)
        for run in (r for r in runs if r.model == name):
            row = run_one(lo, run, args)
            rows.append(row)
            print(f"  {run.target:<5} {run.budget_text:<15} tuned {row['tuned_speedup']:.2f}x "
                  f"uniform {row['uniform_best']} {row['uniform_speedup'] or ''} held-out "
                  f"{_num(row['eval_error'])} feasible={row['feasible']} {row['seconds']:.0f}s "
                  f"(probes {row['probes']}) -> {row['policy']}", flush=True)
    if not rows:
        print("nothing to run", file=sys.stderr)
        return 2

    total = time.monotonic() - started
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.md").write_text(report(rows, models, args, total))
    with open(args.out_dir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out_dir / "speedup.png")
    print()
    print(markdown(rows))
    print(f"\nwrote {args.out_dir}/results.md, results.csv, speedup.png ({total:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
