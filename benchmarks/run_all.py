"""Tune every experiment model for its budgets and targets, and set each tuned policy beside
what a user would do instead: one line of ``torch.autocast``.

For each model x target x budget below, ``autoprec.tuning.tune.tune`` finds a plan at a
deployment batch size where lowering matters on a GPU, and writes the compact policy to
``policies/<model>-<target>[-<budget>].yaml``. Every row is priced the same way — the
cost model's replay of the whole forward under the plan (GEMMs, every cast, norms,
activations, residual adds, fp8 scaling passes; ``autoprec/cost/model.py``) at the same
batch size on the same target profile — and compared with:

- **one global autocast**: ``default: bf16`` or ``default: fp16`` and no rules (what
  ``with torch.autocast(dtype=...)`` around the model runs), the faster of the two whose
  eval-data error is within the budget ("none" when neither is);
- **uniform tf32** (``default: tf32``), always within a few-percent budget;
- **fp8 everywhere**: ``default: bf16`` with fp8 on every eligible Linear (what converting
  every Linear to a float8 one gives), when within budget.

Speed-ups are estimates (over all-fp32 on the target); errors are measured here on the CPU
with the real low-precision arithmetic (fp8 emulated), following the target's autocast op
lists (a CUDA target's layer_norm/softmax in fp32). ``held-out`` is the tuned policy's error
(relative L2 of the outputs) or metric drop on the eval data. ``casts`` is per forward
(activation casts + autocast's per-call weight casts).

Run: ``.venv/bin/python -m benchmarks.run_all`` (about 10 minutes on 2 cores with no
probes cached), ``--quick`` (a subset, under ``benchmarks/results/quick/``) or
``--models trap,gpt``. Writes ``benchmarks/results/results.md``, ``results.csv`` and
``speedup.png``.
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
from autoprec.formats.precisions import PRECISIONS
from autoprec.plan import assignment
from autoprec.policy import Policy, gemm_leaf_paths
from autoprec.policy.modules import format_eligible
from autoprec.trace import trace
from autoprec.trace.graph import LayerGraph
from autoprec.tuning.tune import TuneResult, tune
from autoprec.workload.loading import ModelSpec, load_model_file
from autoprec.workload.metrics import batch_size_of
from autoprec.workload.scoring import Score, reference, score
from benchmarks.common import RESULTS, example

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Model:
    name: str
    batch_size: int  # deployment batch size the speed-ups are priced at
    batch_note: str  # what that batch is, for the table

    @property
    def path(self) -> Path:
        return example(self.name)


# Deployment batch sizes: large enough that the GEMMs are past launch-bound on an H100 (a
# calibration-sized batch prices every precision alike, docs/overview.md), ~16k tokens for the
# transformers.
MODELS = {
    "trap": Model("trap", 65536, "65536 rows"),
    "mixed8": Model("mixed8", 65536, "65536 rows"),
    "wide": Model("wide", 32768, "32768 rows"),
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
    # trap / mixed8: no uniform 16-bit precision meets the budget (fp16 overflows one
    # layer, bf16 drowns another); a100 has no fp8, t4 only fp16.
    Run("trap", "h100", E, 0.01), Run("trap", "a100", E, 0.01), Run("trap", "t4", E, 0.01),
    Run("mixed8", "h100", E, 0.03), Run("mixed8", "a100", E, 0.03),
    # wide: 2048-wide GEMMs where fp8 pays
    Run("wide", "h100", E, 0.05), Run("wide", "h100", E, 0.01),
    # minilm: real weights; the embeddings within 3% / 1% (relative L2), or no retrieval lost
    Run("minilm", "h100", E, 0.03), Run("minilm", "h100", E, 0.01), Run("minilm", "h100", D, 0.0),
    # digits_cnn: at most one test image in 450 lost (accuracy drop 0.005).
    Run("digits_cnn", "h100", D, 0.005),
    Run("gpt", "h100", E, 0.01), Run("gpt", "h100", E, 0.03), Run("gpt", "t4", E, 0.01),
    Run("vit", "h100", E, 0.01),
]
QUICK = [Run("trap", "h100", E, 0.01), Run("mixed8", "h100", E, 0.03),
         Run("gpt", "h100", E, 0.03)]


def policy_path(run: Run, policies: Path) -> Path:
    several = len({(r.kind, r.budget) for r in RUNS if r.model == run.model}) > 1
    return policies / f"{run.model}-{run.target}{f'-{run.tag}' if several else ''}.yaml"


# -- what a user would do instead -------------------------------------------------------

#: The baselines, as policies: one global autocast per dtype, uniform tf32, fp8 everywhere.
BASELINES = ("autocast bf16", "autocast fp16", "tf32", "fp8 everywhere")


@dataclass
class Baseline:
    name: str
    policy: Policy
    score: Score  # on the eval data, applied for a CUDA target (its autocast op lists)

    def value(self, kind: str) -> float:
        return self.score.value if kind == "max_drop" else self.score.error


@dataclass
class Loaded:
    """One model, loaded once: spec (passed to tune), net, graph, baseline scores."""

    model: Model
    spec: ModelSpec
    net: torch.nn.Module  # fp32, for resolving policies (never left lowered)
    graph: LayerGraph
    baselines: list[Baseline]
    seconds: float

    def gemm_precisions(self, policy: Policy) -> dict[str, str]:
        return assignment(policy, self.net, [n.path for n in self.graph.gemm_nodes])


def baseline_policy(name: str, net: torch.nn.Module) -> Policy:
    if name.startswith("autocast "):
        return Policy(default=name.split()[1])
    if name == "tf32":
        return Policy(default="tf32")
    paths = [p for p in gemm_leaf_paths(net) if format_eligible(net.get_submodule(p), "fp8")]
    return Policy(default="bf16", layers=dict.fromkeys(paths, "fp8"))


def load(model: Model) -> Loaded:
    t0 = time.monotonic()
    spec = load_model_file(model.path)
    net = spec.model()
    calib, eval_batches = spec.calibration_batches(), spec.eval_batches()
    graph = trace(net, calib[0], forward=spec.forward, model_name=spec.name)
    ref = reference(spec, net, eval_batches, "of eval_data")
    out = []
    for name in BASELINES:
        pol = baseline_policy(name, net)
        with apply_policy(net, pol, target="h100"):
            out.append(Baseline(name, pol, score(spec, net, eval_batches, ref, "of eval_data")))
    return Loaded(model, spec, net, graph, out, time.monotonic() - t0)


def priced(loaded: Loaded, run: Run, policy: Policy) -> tuple[float, int]:
    """(est. speed-up over fp32, casts per forward) of ``policy`` for ``run``'s target."""
    cost = CostModel(loaded.graph, get_profile(run.target), loaded.model.batch_size)
    bd = cost.breakdown(policy)
    speed = cost.fp32_time / bd.total_s if math.isfinite(bd.total_s) and not \
        cost.cannot_run(policy) else 0.0
    return speed, bd.casts + bd.weight_casts


def best_autocast(loaded: Loaded, run: Run) -> tuple[Baseline | None, float]:
    """The faster global autocast (bf16 / fp16) the target runs within the budget."""
    fits = []
    for b in loaded.baselines:
        if not b.name.startswith("autocast") or b.value(run.kind) > run.budget:
            continue
        speed, _ = priced(loaded, run, b.policy)
        if speed > 0:
            fits.append((round(speed, 9), -b.value(run.kind), b))
    if not fits:
        return None, 0.0
    speed, _, b = max(fits, key=lambda f: f[:2])
    return b, speed


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
    auto, auto_speed = best_autocast(loaded, run)
    tuned_speed, casts = priced(loaded, run, r.policy)
    tf32 = next(b for b in loaded.baselines if b.name == "tf32")
    fp8 = next(b for b in loaded.baselines if b.name == "fp8 everywhere")
    tf32_speed, _ = priced(loaded, run, tf32.policy)
    fp8_speed, _ = priced(loaded, run, fp8.policy)
    counts = Counter(loaded.gemm_precisions(r.policy).values())
    return {
        "model": run.model, "target": run.target, "budget_kind": run.kind,
        "budget": run.budget, "batch_size": loaded.model.batch_size,
        "batch": loaded.model.batch_note, "tuned_speedup": round(tuned_speed, 4),
        "printed_speedup": round(r.est_speedup, 4), "casts": casts,
        "autocast_best": auto.name.split()[1] if auto else "none",
        "autocast_speedup": round(auto_speed, 4) if auto else "",
        "vs_autocast": round(tuned_speed / auto_speed, 3) if auto else "",
        "tf32_speedup": round(tf32_speed, 4),
        "vs_tf32": round(tuned_speed / tf32_speed, 3) if tf32_speed else "",
        "fp8_everywhere": round(fp8_speed, 4) if fp8.value(run.kind) <= run.budget else "",
        "eval_error": r.plan.eval_error, "calib_error": r.error, "feasible": r.feasible,
        "seconds": round(r.costs.seconds, 1), "probes": "ran" if probed else "cached",
        "trials": r.search.trials, "evaluations": round(r.search.evaluations, 2),
        "rules": len(r.policy.layers), "default": r.policy.default,
        "layers": " ".join(f"{p}x{counts[p]}" for p in reversed(PRECISIONS) if counts[p]),
        "policy": str(out.resolve().relative_to(ROOT)) if out.resolve().is_relative_to(ROOT)
        else str(out),
    }


# -- outputs -------------------------------------------------------------------------------


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| model | target | budget | batch | tuned (plan) | one autocast within budget "
            "| tuned / autocast | tf32 | tuned / tf32 | fp8 everywhere | policy | casts "
            "| held-out | evals | tuning s |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        auto = ("none" if r["autocast_best"] == "none"
                else f"{r['autocast_best']} {r['autocast_speedup']:.2f}x")
        budget = f"{'error' if r['budget_kind'] == E else 'drop'} <= {r['budget']:g}"
        fp8 = f"{r['fp8_everywhere']:.2f}x" if r["fp8_everywhere"] != "" else "over budget"
        ratio = f"{r['vs_autocast']:.2f}" if r["vs_autocast"] != "" else "-"
        vs_tf32 = f"{r['vs_tf32']:.2f}" if r["vs_tf32"] != "" else "-"
        tf32 = f"{r['tf32_speedup']:.2f}x" if r["tf32_speedup"] else "n/a"
        flag = "" if r["feasible"] else " (NOT feasible)"
        lines.append(
            f"| {r['model']} | {r['target']} | {budget} | {r['batch']} "
            f"| **{r['tuned_speedup']:.2f}x**{flag} | {auto} | {ratio} "
            f"| {tf32} | {vs_tf32} | {fp8} "
            f"| default {r['default']} + {r['rules']} rules | {r['casts']} "
            f"| {_num(r['eval_error'])} | {r['evaluations']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def baseline_table(models: list[Loaded]) -> str:
    """Every baseline per model: eval-data error (and drop), est. speed-up on h100."""
    lines = ["| model | baseline | eval error (rel. L2) | metric drop | h100 est. speed-up "
             "| casts |", "|---|---|---|---|---|---|"]
    for lo in models:
        run = Run(lo.model.name, "h100", E, 0.0)
        for b in lo.baselines:
            drop = "" if b.score.metric_drop is None else _num(b.value("max_drop"))
            speed, casts = priced(lo, run, b.policy)
            lines.append(f"| {lo.model.name} | {b.name} | {_num(b.score.error)} | {drop} "
                         f"| {speed:.2f}x | {casts} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: tuned vs one global autocast per row (no bar: none within budget)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = list(range(len(rows)))
    w = 0.38
    tuned = [r["tuned_speedup"] if r["feasible"] else 0.0 for r in rows]
    uni = [r["autocast_speedup"] or 0.0 for r in rows]
    ax.bar([i - w / 2 for i in x], tuned, w, label="tuned (autoprec)", color="#1f77b4")
    ax.bar([i + w / 2 for i in x], uni, w, label="one global autocast within budget",
           color="#bbbbbb")
    for i, r in enumerate(rows):
        ax.annotate(f"{tuned[i]:.2f}", (i - w / 2, tuned[i]), ha="center", va="bottom",
                    fontsize=7)
        label = r["autocast_best"] if r["autocast_best"] == "none" else \
            f"{r['autocast_best']}\n{uni[i]:.2f}"
        ax.annotate(label, (i + w / 2, uni[i]), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="fp32")
    ax.set_xticks(x, [f"{r['model']}\n{r['target']}\n"
                      f"{'err' if r['budget_kind'] == E else 'drop'}<={r['budget']:g}"
                      for r in rows], fontsize=7)
    ax.set_ylabel("est. speed-up over fp32 (whole forward, cost model)")
    ax.set_title("tuned plan vs one global autocast meeting the same budget")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max([*tuned, *uni, 1.0]) * 1.2)
    fig.savefig(path, dpi=120)


def report(rows: list[dict[str, Any]], models: list[Loaded], args: argparse.Namespace,
           total: float) -> str:
    cmd = "benchmarks/run_all.py" + (" --quick" if args.quick else "") + (
        f" --models {args.models}" if args.models else "")
    doc = __doc__.split("\n\n")
    details = [f"- {r['model']} {r['target']} {r['budget_kind']} {r['budget']:g}: "
               f"{r['layers']} (calibration {_num(r['calib_error'])}, held-out "
               f"{_num(r['eval_error'])}; tune printed {r['printed_speedup']:.2f}x)"
               for r in rows]
    return "\n\n".join([
        "# autoprec results",
        f"Generated by `.venv/bin/python {cmd}` (seed {args.seed}, {args.trials} trials per "
        f"tune, {total:.0f} s on this machine's CPUs). Estimated speed-ups: the cost model on "
        "the target's datasheet profile (`autoprec/cost/devices.yaml`) at the deployment "
        "batch size, over all-fp32 on the same target.",
        "\n\n".join(doc[1:3]),
        markdown(rows),
        "![tuned vs one global autocast](speedup.png)",
        "## The baselines on the eval data\n\n" + baseline_table(models),
        "## Tuned policies: GEMM nodes per precision\n\n" + "\n".join(details),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a 2-4 minute subset, written under benchmarks/results/quick/")
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--trials", type=int, default=None, help="trials per tune (20; quick 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="results folder (benchmarks/results; quick: .../results/quick)")
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
    args.out_dir = args.out_dir or RESULTS / ("quick" if args.quick else "")
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
              f"{lo.model.batch_note}; baselines scored in {lo.seconds:.0f}s", flush=True)
        for run in (r for r in runs if r.model == name):
            row = run_one(lo, run, args)
            rows.append(row)
            print(f"  {run.target:<5} {run.budget_text:<15} tuned {row['tuned_speedup']:.2f}x "
                  f"autocast {row['autocast_best']} {row['autocast_speedup'] or ''} tf32 "
                  f"{row['tf32_speedup'] or 0:.2f}x held-out {_num(row['eval_error'])} "
                  f"feasible={row['feasible']} {row['seconds']:.0f}s (probes {row['probes']})"
                  f" -> {row['policy']}", flush=True)
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
