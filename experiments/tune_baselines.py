"""How does ``autoprec tune`` compare with the searches other tools use? (issue 6)

For each model and error budget, at a deployment batch size where lowering matters
(estimated on the h100 profile), this reports the speed-up each method reaches within
budget and the model evaluations it spent:

1. ``tune``: autoprec's default strategy (a best-first walk over assignments, fastest
   first by the cost model, evaluating only those the probes predict within 1.25x the
   budget; then TPE, skipping proposals slower than the best feasible trial or hopeless
   by the probes) with ``--trials`` trials;
2. ``uniform``: tf32 / bf16 / fp16 / fp8 on every layer that may take it; the best
   within budget;
3. greedy per-layer fallback from everything at its fastest precision, one evaluation per
   step: ``greedy-probe`` falls back the layer the probes rate most sensitive (the probes
   are charged to it), ``greedy-inc`` is Neural Compressor's ``basic`` strategy (rank by
   one-at-a-time fallback evaluations, then accumulate);
4. ``bisect``: onnxconverter-common's segment bisection (``auto_mixed_precision``);
5. ``random``: uniform random assignments, as many evaluations as ``tune`` spent;
6. ``optimum`` (models small enough): every assignment priced, evaluated fastest-first
   until one is within budget on calibration and eval data — the exact optimum;
   cross-checked by brute force over every {fp32, bf16, fp16} assignment;

The baselines live in ``experiments/baselines/`` (how each is adapted is documented
there); all methods share autoprec's evaluator, cost model and selection rule
(``select.choose``: fastest calibration-feasible candidate confirmed on eval data), so they
differ only in the search. ``evaluations`` are model evaluations in full-calibration-set
equivalents (a screened assignment costs a quarter); ``probe`` is the probes' cost in
forward-pass equivalents over the calibration set, charged to the methods that use them;
``seconds`` are wall seconds on this (shared, loaded) machine, one torch thread.
``feasible`` means within budget on the eval data (all-fp32, always feasible, is every
method's fallback). ``gap`` is the shortfall against the eval-confirmed optimum. A
baseline is stopped after ``--cap`` evaluations (noted when it happens).

Run: ``.venv/bin/python experiments/tune_baselines.py`` (about 6-10 minutes on 2 loaded
cores) or ``--quick`` (trap and tinygpt at one budget, 1-3 minutes). Writes
``experiments/results/tune_baselines.md`` and ``.csv`` (``--out-dir`` to change).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from autoprec.search.tune import tune

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import methods  # noqa: E402
from baselines.problem import Counter, Exhausted, Model, Outcome, Problem, load  # noqa: E402

HERE = Path(__file__).resolve().parent
ALL = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass
class Config:
    name: str
    path: Path
    batch_size: int
    batch_note: str
    budgets: tuple[float, ...]
    exhaustive: bool


CONFIGS = {
    # 65536 rows of 256 features: every GEMM is well past launch-bound on an H100.
    "trap": Config("trap", HERE / "trap" / "model.py", 65536, "65536 rows",
                   (0.005, 0.01, 0.02), True),
    # 256 sequences x 32 tokens (8k tokens, as 64 sequences of 128), hidden 1024: fp8
    # beats bf16 on the large GEMMs only after paying its scaling passes.
    "tinygpt": Config("tinygpt", HERE / "baselines" / "models" / "tinygpt" / "model.py", 256,
                      "256 seq x 32 tok", (0.005, 0.01, 0.03), False),
    # all-MiniLM-L6-v2, real weights: embedding a corpus in batches of 1024 sentences.
    # Budget: relative L2 of the normalised embeddings.
    "minilm": Config("minilm", HERE / "minilm" / "model.py", 1024, "1024 sentences",
                     (0.002, 0.01), False),
}


def run_tune(cfg: Config, model: Model, budget: float, trials: int, seed: int,
             work: Path) -> tuple[Outcome, object]:
    cache = work / "probe-cache"
    r = tune(cfg.path, max_error=budget, precisions=list(model.precisions), target=model.target,
             batch_size=cfg.batch_size, trials=trials, seed=seed, out=work / "policy.yaml",
             progress=False, storage="memory", cache_dir=cache)
    table = model.load_table(cache)  # the same probes (a cache hit the first time)
    params = model.space.params(r.policy.layers)
    check = model.speedup(params)
    if not math.isclose(check, r.est_speedup, rel_tol=1e-6):
        print(f"  warning: tune's policy re-priced at {check:.4f}x, tune said "
              f"{r.est_speedup:.4f}x", file=sys.stderr)
    out = Outcome("tune", params, r.est_speedup, r.error, r.eval_error, r.feasible,
                  r.evaluations, r.seconds, float(table.meta.get("cost_total", math.nan)),
                  note=f"{r.trials} trials")
    return out, r


def run_budget(cfg: Config, model: Model, budget: float, args: argparse.Namespace,
               work: Path) -> tuple[list[Outcome], methods.Optimum | None, list[dict], str]:
    t_out, r = run_tune(cfg, model, budget, args.trials, args.seed, work)
    table = model.table
    assert table is not None
    probe_cost = float(table.meta.get("cost_total", math.nan))
    probe_seconds = float(table.meta.get("seconds", 0.0))
    problem = Problem(model, budget)
    outs = [t_out]
    runs: list[tuple[str, Callable[[Counter], str | None], dict]] = [
        ("uniform", lambda c: methods.uniform(problem, c), {}),
        ("greedy-probe", lambda c: methods.greedy_probe(problem, c, table),
         {"probe_cost": probe_cost, "probe_seconds": probe_seconds}),
        ("greedy-inc", lambda c: methods.greedy_inc(problem, c), {}),
        ("bisect", lambda c: methods.segment_bisect(problem, c), {}),
        ("random", lambda c: methods.random_search(problem, c, t_out.evaluations, args.seed),
         {}),
    ]
    for name, fn, kw in runs:
        c = problem.counter(cap=args.cap)
        note = ""
        try:
            note = fn(c) or ""
        except Exhausted as err:
            note = str(err)
        outs.append(c.outcome(name, note=note, **kw))

    if cfg.exhaustive and args.long_trials:  # does a larger trial budget close the gap?
        t_long, _ = run_tune(cfg, model, budget, args.long_trials, args.seed, work / "long")
        t_long.method = f"tune T={args.long_trials}"
        outs.append(t_long)

    opt, check = None, ""
    if cfg.exhaustive and not args.no_exhaustive:
        c = problem.counter()
        opt = methods.exhaustive(problem, c)
        if opt is not None and opt.params is not None:
            ev = c.seen[problem.evaluator.key(opt.params)]
            outs.append(Outcome("optimum", opt.params, opt.speedup, ev.error, opt.eval_error,
                                True, c.evaluations, c.seconds,
                                note=f"{opt.walked} of {opt.assignments} walked"))
        check = _brute_force_check(problem)
    return outs, opt, r.trials_table, check


def _brute_force_check(problem: Problem) -> str:
    """Evaluate every {fp32, bf16, fp16} assignment and compare the best with the
    fastest-first walk over the same subspace: the walk's shortcut must not change the
    answer."""
    sub = methods.subspace(problem.space, ("fp32", "bf16", "fp16"))
    c = problem.counter()
    n = methods.enumerate_all(problem, c, sub)
    brute = c.outcome("enumerate")
    walk = methods.exhaustive(problem, problem.counter(), space=sub)
    assert walk is not None
    agree = walk.params is not None and math.isclose(walk.speedup, brute.est_speedup)
    return (f"brute force over the {n} {{fp32, bf16, fp16}} assignments ({c.evaluations:.0f} "
            f"evaluations): best within budget {brute.est_speedup:.3f}x "
            f"(`{_fmt_policy(brute.params)}`, eval error {brute.eval_error:.3g}); "
            f"the fastest-first walk over the same {n} finds {walk.speedup:.3f}x after "
            f"{walk.walked} -> {'agree' if agree else 'DISAGREE'}")


def _fmt_policy(params: dict[str, str], full: bool = False) -> str:
    """``layer=precision`` for the lowered layers; on big models (``full`` False) a count
    per precision, naming the layers only for precisions with few of them."""
    low = {k: v for k, v in params.items() if v != "fp32"}
    if not low:
        return "all fp32"
    if full or len(low) <= 8:
        return " ".join(f"{k}={v}" for k, v in low.items())
    by: dict[str, list[str]] = {}
    for k, v in params.items():
        by.setdefault(v, []).append(k)
    return "; ".join(f"{p}: {', '.join(ks)}" if len(ks) <= 4 else f"{p}: {len(ks)} layers"
                     for p, ks in by.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="trap and tinygpt at budget 0.01, 20 trials (1-3 min)")
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--budgets", default=None, help="comma list overriding each model's")
    ap.add_argument("--trials", type=int, default=None, help="tune trials (default 40, as the CLI; 20 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-trials", type=int, default=None,
                    help="also run tune with this many trials on the small models "
                         "(default 200; 0 to skip; skipped with --quick)")
    ap.add_argument("--no-exhaustive", action="store_true")
    ap.add_argument("--cap", type=float, default=150.0,
                    help="evaluations after which a baseline is stopped (time limit)")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = (args.models.split(",") if args.models
             else ["trap", "tinygpt"] if args.quick else list(CONFIGS))
    args.trials = args.trials or (20 if args.quick else 40)
    if args.long_trials is None:
        args.long_trials = 0 if args.quick else 200
    started = time.monotonic()

    rows: list[dict] = []
    details: list[str] = []
    verdicts: list[str] = []
    for name in names:
        cfg = CONFIGS[name]
        budgets = (tuple(float(b) for b in args.budgets.split(",")) if args.budgets
                   else (0.01,) if args.quick else cfg.budgets)
        t0 = time.monotonic()
        model = load(cfg.path, precisions=ALL, target="h100", batch_size=cfg.batch_size)
        print(f"# {name}: {len(model.space.variables)} variables, space "
              f"{model.space.size:.3g} assignments, loaded in {time.monotonic() - t0:.1f}s",
              flush=True)
        for budget in budgets:
            with tempfile.TemporaryDirectory() as tmp:
                outs, opt, trials, check = run_budget(cfg, model, budget, args, Path(tmp))
            best = opt.speedup if opt is not None and opt.params is not None else None
            for o in outs:
                gap = (1 - o.within_budget_speedup / best) if best else math.nan
                rows.append({
                    "model": name, "budget": budget, "batch": cfg.batch_note,
                    "method": o.method, "est_speedup": o.est_speedup,
                    "within_budget": o.within_budget_speedup, "feasible": o.feasible,
                    "calib_error": o.error, "eval_error": o.eval_error,
                    "evaluations": o.evaluations, "probe": o.probe_cost,
                    "seconds": o.seconds, "gap": gap, "note": o.note,
                    "policy": _fmt_policy(o.params, full=True),
                })
                print(f"  {budget:<6g} {o.method:<13} {o.est_speedup:6.3f}x "
                      f"feasible={o.feasible!s:<5} eval_err={o.eval_error:.4g} "
                      f"evals={o.evaluations:6.2f} probe={o.probe_cost:4.0f} "
                      f"{o.seconds:6.1f}s {o.note}", flush=True)
            verdicts.append(_verdict(name, budget, outs, opt))
            details.append(_details(name, budget, outs, opt, trials, check))
            if check:
                print(f"  {check}", flush=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    table = _markdown(rows)
    total = time.monotonic() - started
    print()
    print(table)
    print("\n".join(verdicts))
    (args.out_dir / "tune_baselines.md").write_text(
        _report(table, verdicts, details, args, total))
    with open(args.out_dir / "tune_baselines.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {args.out_dir / 'tune_baselines.md'} and .csv ({total:.0f}s)")
    return 0


def _markdown(rows: list[dict]) -> str:
    head = ("| model | budget | batch | method | est_speedup | feasible (eval) | eval_error "
            "| evaluations | probe | seconds | gap to optimum |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        gap = "" if math.isnan(r["gap"]) else f"{100 * r['gap']:.1f}%"
        probe = f"{r['probe']:.0f}" if r["probe"] else ""
        lines.append(
            f"| {r['model']} | {r['budget']:g} | {r['batch']} | {r['method']} "
            f"| {r['est_speedup']:.3f}x | {'yes' if r['feasible'] else 'NO'} "
            f"| {r['eval_error']:.3g} | {r['evaluations']:.2f} | {probe} "
            f"| {r['seconds']:.1f} | {gap} |")
    return "\n".join(lines)


def _verdict(name: str, budget: float, outs: list[Outcome],
             opt: methods.Optimum | None) -> str:
    by = {o.method: o for o in outs}
    t = by["tune"]
    others = [o for o in outs
              if o.method not in ("tune", "optimum") and
              not o.method.startswith("tune ")]
    best_other = max(others, key=lambda o: o.within_budget_speedup)
    ok_best = t.within_budget_speedup >= best_other.within_budget_speedup * (1 - 1e-9)
    parts = [f"- {name} @ {budget:g}: tune {t.within_budget_speedup:.3f}x vs best baseline "
             f"{best_other.method} {best_other.within_budget_speedup:.3f}x -> "
             f"{'not worse' if ok_best else 'WORSE'}"]
    if opt is not None and opt.params is not None:
        gap = 1 - t.within_budget_speedup / opt.speedup
        parts.append(f"optimum {opt.speedup:.3f}x, gap {100 * gap:.1f}% -> "
                     f"{'within 2%' if gap <= 0.02 else 'NOT within 2%'}")
        if opt.calib_params is not None and opt.calib_params != opt.params:
            parts.append(f"(calibration optimum {opt.calib_speedup:.3f}x fails on eval data)")
    else:
        top = max(outs, key=lambda o: o.within_budget_speedup)
        gap = 1 - t.within_budget_speedup / top.within_budget_speedup
        parts.append(f"optimum unknown; best found {top.within_budget_speedup:.3f}x "
                     f"({top.method}), tune {100 * gap:.1f}% below it")
    g = min(by["greedy-probe"].evaluations, by["greedy-inc"].evaluations)
    parts.append(f"evaluations {t.evaluations:.2f} vs greedy {by['greedy-probe'].evaluations:.2f}"
                 f" (probe) / {by['greedy-inc'].evaluations:.2f} (inc) -> "
                 f"{'fewer' if t.evaluations < g else 'NOT fewer'}")
    return "; ".join(parts)


def _details(name: str, budget: float, outs: list[Outcome], opt: methods.Optimum | None,
             trials: list[dict], check: str) -> str:
    lines = [f"### {name} @ {budget:g}", ""]
    for o in outs:
        lines.append(f"- **{o.method}** {o.est_speedup:.3f}x (calib {o.error:.4g}, eval "
                     f"{o.eval_error:.4g}): `{_fmt_policy(o.params)}`")
    if opt is not None:
        lines.append(f"- optimum search: {opt.walked} of {opt.assignments} assignments "
                     f"evaluated fastest-first; calibration optimum {opt.calib_speedup:.3f}x "
                     f"{'holds' if opt.calib_holds_on_eval else 'FAILS'} on eval data")
    if check:
        lines.append(f"- {check}")
    phases: dict[str, list[str]] = {}
    for t in trials:
        mark = "+" if t.get("feasible") else "-"
        sp = t.get("est_speedup")
        phases.setdefault(str(t.get("phase")), []).append(
            f"{sp:.2f}{mark}" if isinstance(sp, float) else "fail")
    lines.append("- tune trials by phase (est speed-up, + within budget on calibration): "
                 + "; ".join(f"{k}: {' '.join(v)}" for k, v in phases.items()))
    return "\n".join(lines)


def _report(table: str, verdicts: list[str], details: list[str], args: argparse.Namespace,
            total: float) -> str:
    doc = __doc__.split("\n\n")
    return "\n\n".join([
        "# tune vs baselines (issue 6)",
        "Generated by `experiments/tune_baselines.py"
        + (" --quick" if args.quick else "") + f"` (seed {args.seed}, {args.trials} tune "
        f"trials, {total:.0f} s). Target: h100 profile, estimated speed-ups (cost model).",
        "\n\n".join(doc[1:4]),
        table,
        "## Targets\n\n" + "\n".join(verdicts),
        "## Details\n\n" + "\n\n".join(details),
    ]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
