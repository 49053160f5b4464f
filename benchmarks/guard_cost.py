"""What the run-time guard (apply.guard) costs, and what it does on mixed8.

**Cost.** examples/minilm and examples/wide, deployed (``form: deploy``), with and
without the guard, eager and compiled (inductor), on this CPU:

- ``bf16`` deploy plan, ``guard: {mode: detect, layers: all}``: every GEMM leaf checked (the
  default selection checks none here: bf16 has fp32's range) — the most a user can ask;
- ``fp16`` deploy plan (uniform: ``default: fp16``, no rules, what tune writes when
  ``model.to(float16)`` wins), ``guard: detect`` and ``guard: fallback``: the default
  selection, every fp16 GEMM leaf (a fallback's re-run installs the consumer casts it
  needs for the re-run only: its fast path is detect's).

Timing: ``torch.set_num_threads(1)``, the calling thread's CPU time (``time.thread_time``:
other processes on a shared machine do not inflate it), interleaved rounds (each round
times every variant in a fresh random order, ``--iters`` forwards after a warm-up); the
ratio is the median over rounds of guarded / unguarded in the same round. Target: <= 1.03.

**Demonstration.** examples/mixed8 under examples/mixed8/guarded.yaml (its h100 plan
with wide1 / wide2 in fp16), the calibration batch scaled 3e4x so that wide1's fp16
overflows: off / detect / fallback / raise, and fallback against the plan with wide1
raised to bf16 applied directly. Then the uniform plan ``default: fp16`` (no rules) on
mixed8's calibration batch, where range_block overflows fp16 (issue 47: fallback and raise
crashed there in torch), against the plan with range_block raised to bf16.

    python -m benchmarks.guard_cost --out benchmarks/results      # ~10 min on 2 cores
    python -m benchmarks.guard_cost --smoke                        # seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import apply_policy
from autoprec.device.capability import cpu_facts
from autoprec.errors import GuardError
from autoprec.policy import Policy, load_policy
from autoprec.workload.loading import load_model_file
from benchmarks.common import EXAMPLES, example

SCALE = 3e4


def _variant(spec: Any, policy: Policy, guard: Any, compiled: bool) -> tuple[Any, Any]:
    net = spec.model()
    handle = apply_policy(net, policy, guard=guard, target="cpu")
    run = torch.compile(net) if compiled else net
    return run, handle


def _time(runs: dict[str, Any], spec: Any, batch: Any, rounds: int, iters: int
          ) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in runs}
    with torch.no_grad():
        for m in runs.values():  # warm-up (and the compile)
            spec.forward(m, batch)
            spec.forward(m, batch)
        for _ in range(rounds):
            order = list(runs)
            random.shuffle(order)
            for k in order:
                t = time.thread_time()
                for _ in range(iters):
                    spec.forward(runs[k], batch)
                out[k].append((time.thread_time() - t) / iters)
    return out


def cost_table(models: list[str], rounds: int, iters: int, compiled_too: bool) -> str:
    lines = ["| model | plan | mode | guarded layers | unguarded ms | guarded ms | ratio "
             "(median of rounds) |", "|---|---|---|---|---|---|---|"]
    for name in models:
        spec = load_model_file(example(name))
        batch = spec.calibration_batches()[0]
        for default, guard in (("bf16", {"mode": "detect", "layers": "all"}),
                               ("fp16", "detect"), ("fp16", "fallback")):
            pol = Policy(default=default, form="deploy")
            for compiled in (False, True) if compiled_too else (False,):
                plain, h0 = _variant(spec, pol, "off", compiled)
                guarded, h1 = _variant(spec, pol, guard, compiled)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t = _time({"off": plain, "on": guarded}, spec, batch, rounds, iters)
                ratio = statistics.median(b / a for a, b in zip(t["off"], t["on"]))
                n = len(h1.guard.layers) if h1.guard is not None else 0
                mode = "compiled" if compiled else "eager"
                label = f"{default} deploy, guard " + ("detect, layers: all"
                                                       if isinstance(guard, dict) else guard)
                lines.append(f"| {name} | {label} | {mode} | {n} | "
                             f"{statistics.median(t['off']) * 1e3:.2f} | "
                             f"{statistics.median(t['on']) * 1e3:.2f} | {ratio:.3f} |")
                print(lines[-1], flush=True)
                h0.remove()
                h1.remove()
                torch._dynamo.reset()
    return "\n".join(lines)


def demo_table(pol: Policy, layer: str, scale: float) -> str:
    """off / detect / fallback / raise on mixed8 under ``pol``, its calibration batch
    times ``scale``; fallback against ``pol`` with ``layer`` raised to bf16."""
    spec = load_model_file(example("mixed8"))
    x = spec.calibration_batches()[0] * scale
    net = spec.model()
    with torch.no_grad():
        ref = net(x)  # fp32: finite
        with apply_policy(net, Policy(default=pol.default, form="deploy", model=pol.model,
                                      layers={**pol.layers, layer: "bf16"})):
            direct = net(x)
    lines = [f"| guard | output finite | rel. error vs fp32 | {layer} checks / overflows / "
             "fallbacks | what the caller sees |", "|---|---|---|---|---|"]
    for mode in ("off", "detect", "fallback", "raise"):
        seen = ""
        y = None
        with torch.no_grad(), apply_policy(net, pol, guard=mode) as h, \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                y = net(x)
            except GuardError as err:
                seen = f"GuardError: {err}"
            stats = h.guard_stats().get(layer)
        if y is not None:
            msgs = [str(w.message) for w in caught if "guard:" in str(w.message)]
            seen = (f"{len(msgs)} GuardWarning(s), first: {msgs[0]}" if msgs
                    else "nothing (the output as computed)")
            if mode == "fallback":
                seen += f"; equal to the plan with {layer}: bf16 applied directly: " \
                        f"{torch.equal(y, direct)}"
        finite = "-" if y is None else str(bool(torch.isfinite(y).all()))
        err = "-" if y is None else f"{float((y.float() - ref).norm() / ref.norm()):.3g}"
        counts = "-" if stats is None else \
            f"{stats.checks} / {stats.overflows} / {stats.fallbacks}"
        lines.append(f"| {mode} | {finite} | {err} | {counts} | {seen} |")
    return "\n".join(lines)


def demos() -> tuple[str, str]:
    """The guarded mixed8 plan (x 3e4), and the uniform fp16 plan (calibration batch)."""
    pol = load_policy(EXAMPLES / "mixed8" / "guarded.yaml")
    pol.source = "examples/mixed8/guarded.yaml"  # as the messages name it from the repo
    uniform = Policy(default="fp16", form="deploy", model=pol.model, target=pol.target)
    uniform.source = "default: fp16 (uniform)"
    with warnings.catch_warnings():  # the hand-written uniform plan: no fingerprint check
        warnings.simplefilter("ignore")
        return demo_table(pol, "wide1", SCALE), demo_table(uniform, "range_block", 1.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="folder for guard_cost.md")
    ap.add_argument("--smoke", action="store_true", help="one round, eager, wide only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    cpu = cpu_facts()
    print(f"CPU: {cpu}; torch {torch.__version__}, 1 thread", flush=True)
    demo, uniform = demos()
    print(demo, uniform, sep="\n\n", flush=True)
    if args.smoke:
        cost = cost_table(["wide"], 1, 1, compiled_too=False)
    else:
        cost = cost_table(["minilm", "wide"], args.rounds, args.iters, compiled_too=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "guard_cost.md").write_text(
            "# The run-time guard: cost and what it does (issues 32, 47)\n\n"
            f"Written by `python -m benchmarks.guard_cost --out benchmarks/results`.\n"
            f"CPU: {cpu}; torch {torch.__version__}; 1 thread, thread CPU time, "
            f"{args.rounds} interleaved rounds of {args.iters} forwards (the machine was "
            "shared with other engineers' jobs: thread time keeps their load out, not "
            "their cache and memory-bandwidth traffic).\n\n"
            "## Guard cost (deploy form)\n\n" + cost + "\n\n"
            "## mixed8, calibration batch x 3e4 (examples/mixed8/guarded.yaml)\n\n"
            + demo + "\n\n"
            "## mixed8, uniform `default: fp16` (no rules), calibration batch: range_block "
            "overflows\n\n" + uniform + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
