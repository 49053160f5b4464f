"""The deploy form against the one-liner every deployment uses: ``model.to(torch.bfloat16)``.

Two parts, each printing a markdown table (``--out DIR`` also writes deploy_form.md):

``--part h100`` (the cost model, any machine): ``tune --target h100`` in the deploy form
(the default) and, for comparison, in the train form (autocast over fp32 masters: what
earlier rounds wrote), for MiniLM at 1024 and at 8 sentences, mixed8 at 65536 rows and a
new user's 4-block encoder (width 256) at its calibration batch. Every row is priced by the
same replay of every op the applied model runs; weights are the bytes the plan holds.

``--part cpu`` (measured on this machine): ``tune --target cpu`` (deploy form; calibrated
here, its own timing step on), eager and ``--compile``, for examples/minilm at 3 % and
examples/wide at 5 %; then an independent timing written here, not autoprec's: fp32,
one ``torch.autocast(bf16)``, the real one-liners ``copy.deepcopy(model).to(torch.bfloat16)``
/ ``.to(torch.float16)`` fed cast inputs, and the written policy applied — interleaved
rounds on one torch thread, thread CPU time, median of per-round ratios to fp32 (each row
``torch.compile``'d for the compiled table). ``written / best`` is the written plan's
speed-up over the fastest row within budget (>= 0.95 asked).

    python -m benchmarks.deploy_form --part h100 --out benchmarks/results
    python -m benchmarks.deploy_form --part cpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import apply_policy
from autoprec.device.capability import cpu_facts
from autoprec.evaluation.rows import label
from autoprec.lower.stored import cast_tree
from autoprec.tuning.tune import tune
from autoprec.workload.loading import load_model_file
from autoprec.workload.scoring import reference, score
from benchmarks.common import example

#: (model folder, deployment batch size or None, budget) for the h100 part
H100 = [("minilm", 1024, 0.03), ("minilm", 8, 0.03), ("mixed8", 65536, 0.03),
        ("encoder4", None, 0.01)]
#: (model folder, budget) for the measured CPU part
CPU = [("minilm", 0.03), ("wide", 0.05)]


def _mb(b: Any) -> str:
    return "-" if b is None else f"{b / 1e6:.1f}"


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _tune(name: str, out: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tune(example(name), out=out, progress=False, **kw)


# -- h100: the cost model ---------------------------------------------------------------------

def h100_part(trials: int) -> str:
    lines = ["| model, batch, budget | plan | error | est. speed-up (h100) | weights MB | "
             "within budget |", "|---|---|---|---|---|---|"]
    for name, bs, budget in H100:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            dep = _tune(name, Path(tmp) / "d.yaml", target="h100", batch_size=bs,
                        max_error=budget, trials=trials, form="deploy")
            took = time.perf_counter() - t0
            old = _tune(name, Path(tmp) / "t.yaml", target="h100", batch_size=bs,
                        max_error=budget, trials=trials, form="train")
        batch = dep.policy.target.get("batch_size")
        case = f"{name}, {batch}, {budget:g}"
        rows = {r.name: r for r in dep.plan.speed.rows}
        told = {r.name: r for r in old.plan.speed.rows}

        def line(plan: str, r: Any, case: str = case) -> None:
            ok = "yes" if r.feasible else (r.why_not or "no")
            err = "-" if r.error is None else f"{r.error:.4g}"
            lines.append(f"| {case} | {plan} | {err} | {_x(r.est_speedup)} | "
                         f"{_mb(r.weight_bytes)} | {ok} |")

        pol = dep.policy
        line(f"**written (deploy form)**: default {pol.default}, {len(pol.layers)} rules "
             f"({took:.0f} s)", rows["tuned"])
        opol = old.policy
        line(f"written, train form: default {opol.default}, {len(opol.layers)} rules",
             told["tuned"])
        for p, form in (("fp32", "train"), ("bf16", "train"), ("bf16", "deploy"),
                        ("fp16", "deploy")):
            r = rows.get(label(p, form))
            if r is not None and r.policy is not None:
                line(label(p, form), r)
        print(f"[h100] {case}: written {_x(rows['tuned'].est_speedup)}", file=sys.stderr)
    return "\n".join(lines)


# -- cpu: measured here ---------------------------------------------------------------------

def _variants(spec: Any, policy_path: Path) -> dict[str, Any]:
    """name -> (model, run(batch)) as a user would write each, on copies of one model."""
    base = spec.model()
    out: dict[str, Any] = {}
    out["fp32"] = (base, lambda m, b: spec.forward(m, b))

    def autocast_run(m: Any, b: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return spec.forward(m, b)

    out["one autocast bf16"] = (copy.deepcopy(base), autocast_run)
    for dt, nm in ((torch.bfloat16, "model.to(bfloat16)"), (torch.float16, "model.to(float16)")):
        out[nm] = (copy.deepcopy(base).to(dt),
                   lambda m, b, dt=dt: spec.forward(m, cast_tree(b, dt)))
    mine = copy.deepcopy(base)
    handle = apply_policy(mine, policy_path)
    out["written policy"] = (mine, lambda m, b: spec.forward(m, b))
    out["_handle"] = handle
    return out


def _time(runs: dict[str, Any], rounds: int, seconds: float) -> dict[str, list[float]]:
    """Interleaved rounds, one torch thread, thread CPU time (a forward repeated to at
    least ``seconds`` per sample)."""
    samples: dict[str, list[float]] = {k: [] for k in runs}
    rng = random.Random(0)
    reps = {}
    for k, f in runs.items():  # warm up; how many forwards make one sample
        f()
        t = time.thread_time()
        f()
        reps[k] = max(1, int(seconds / max(time.thread_time() - t, 1e-6)))
    n = max(reps.values())
    for _ in range(rounds):
        order = list(runs)
        rng.shuffle(order)
        for k in order:
            t = time.thread_time()
            for _ in range(n):
                runs[k]()
            samples[k].append((time.thread_time() - t) / n)
    return samples


def cpu_part(trials: int, rounds: int) -> str:
    torch.set_num_threads(1)
    lines = [f"CPU: {cpu_facts()}; 1 torch thread, thread CPU time, {rounds} interleaved "
             "rounds.", "",
             "| model, budget, mode | written plan (tune: est / measured) | row | error | "
             "measured (p10-p90) | weights MB | within budget |",
             "|---|---|---|---|---|---|---|"]
    checks = []
    for name, budget in CPU:
        for compiled in (False, True):
            mode = "compile" if compiled else "eager"
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{name}.yaml"
                res = _tune(name, path, target="cpu", max_error=budget, trials=trials,
                            compile=compiled)
                spec = load_model_file(example(name))
                variants = _variants(spec, path)
                handle = variants.pop("_handle")
                batches = spec.eval_batches()
                ref = reference(spec, variants["fp32"][0], batches)
                errors, weights, runs, kernels = {}, {}, {}, {}
                batch = spec.calibration_batches()[0]
                for k, (m, run) in variants.items():
                    errors[k] = 0.0 if k == "fp32" else _error(spec, m, run, batches, ref)
                    weights[k] = handle.weight_bytes() if k == "written policy" else \
                        sum(t.numel() * t.element_size()
                            for t in [*m.parameters(), *m.buffers()])
                    fn = torch.compile(m) if compiled else m
                    runs[k] = (lambda fn=fn, run=run, b=batch: _no_grad(run, fn, b))
                    if compiled:  # compile now: what inductor generated for each row
                        from torch._inductor import metrics

                        metrics.reset()
                        runs[k]()
                        kernels[k] = metrics.generated_kernel_count
                samples = _time(runs, rounds, 0.05)
                handle.remove()
            import numpy as np

            ref_t = np.asarray(samples["fp32"])
            stats = {}
            for k, s in samples.items():
                r = ref_t / np.asarray(s)
                stats[k] = tuple(float(v) for v in np.percentile(r, [50, 10, 90]))
            ok = {k: errors[k] <= budget for k in stats}
            best = max(stats[k][0] for k in stats if ok[k])
            written = stats["written policy"][0]
            pol = res.policy
            head = (f"default {pol.default}, {len(pol.layers)} rules: est "
                    f"{res.est_speedup:.2f}x / measured "
                    f"{_x(pol.metrics.get('measured_speedup'))}")
            for k in stats:
                med, lo, hi = stats[k]
                lines.append(f"| {name}, {budget:g}, {mode} | {head} | {k} | {errors[k]:.4g} | "
                             f"{med:.2f}x ({lo:.2f}-{hi:.2f}) | {_mb(weights[k])} | "
                             f"{'yes' if ok[k] else 'no'} |")
                head = ""
            checks.append(f"{name} {mode}: written / best within budget = {written / best:.3f}; "
                          f"written weights {_mb(weights['written policy'])} MB vs "
                          f"model.to(bf16) {_mb(weights['model.to(bfloat16)'])} MB"
                          + (f"; inductor kernels {kernels}" if kernels else ""))
            print(f"[cpu] {checks[-1]}", file=sys.stderr)
    return "\n".join(lines + [""] + [f"- {c}" for c in checks])


def _no_grad(run: Any, m: Any, batch: Any) -> Any:
    with torch.no_grad():
        return run(m, batch)


def _error(spec: Any, m: Any, run: Any, batches: Any, ref: Any) -> float:
    """Relative L2 of ``run(m, batch)`` over ``batches`` against the fp32 reference (the
    library's own measure, fed the variant's outputs)."""
    from dataclasses import replace

    return float(score(replace(spec, forward=run), m, batches, ref).error)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("h100", "cpu", "all"), default="all")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    parts = []
    if args.part in ("h100", "all"):
        parts.append("## h100 profile (cost model)\n\n" + h100_part(args.trials))
    if args.part in ("cpu", "all"):
        parts.append("## measured on this CPU (--target cpu)\n\n" + cpu_part(args.trials,
                                                                              args.rounds))
    text = "\n\n".join(parts)
    print(text)
    if args.out is not None:
        name = "deploy_form.md" if args.part == "all" else f"deploy_form_{args.part}.md"
        cmd = "python -m benchmarks.deploy_form " + " ".join(argv or sys.argv[1:])
        (args.out / name).write_text(f"# The deploy form vs the one-liners\n\n`{cmd}`\n\n"
                                     f"{text}\n")


if __name__ == "__main__":
    main()
