"""Does the cost model rank policies the way this CPU really runs them?

A stack of Linear blocks (``Linear -> GELU -> Linear -> LayerNorm``, widths mixed so that
some GEMMs are compute-bound and some dominated by casts and set-up) runs under ~15
policies — regions (``default: bf16``, ``default: fp16``), the old per-leaf islands
(``default: fp32`` + one rule per leaf), regions with exceptions and random mixes — each
applied with ``apply_policy(..., target="cpu")`` and timed on this CPU. The same policies
are priced by ``CostModel`` (the whole forward replayed under each plan: GEMMs, casts,
norms, activations) on the ``cpu`` profile, and Spearman's rank correlation of estimated vs
measured time is reported (target >= 0.8), once with the shipped profile and once with the
profile fitted (``calibrate.fit``) on micro-benchmarks (single GEMMs per precision, a copy,
a tiny add; never on the policies being ranked). A plan the cost model says cannot run is
also run for real, to see that it fails.

Timing: one torch thread, timed by the thread's CPU time (``measure_latency(clock=
"thread")``): this team's 2-core machines are shared, and with 2 OpenMP threads each
parallel region waits for a descheduled sibling (wall times of one forward varied 10x under
load); policies are measured in random order.

    python -m benchmarks.cost_model_cpu              # the benchmark (< 1 min on 2 cores)
    python -m benchmarks.cost_model_cpu --profile    # re-measure the cpu profile's figures
    python -m benchmarks.cost_model_cpu --smoke      # seconds; used by the tests
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, Sample, fit, get_profile
from autoprec.device.capability import cpu_facts
from autoprec.measure import measure_latency, micro_samples
from autoprec.policy import Policy, PolicyWarning, gemm_leaf_paths
from autoprec.trace import trace

PRECS = ("fp32", "bf16", "fp16")  # what the cpu profile supports
def timed(run, warmup: int, repeats: int) -> float:
    return measure_latency(run, "cpu", warmup, repeats, clock="thread").median_s


class Block(nn.Module):
    """Linear -> GELU -> Linear -> LayerNorm, no residual (dtype flows along the chain)."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        return self.norm(self.fc2(self.act(self.fc1(x))))


def build_model(d: int, hidden: list[int], head: int) -> nn.Module:
    return nn.Sequential(*[Block(d, h) for h in hidden], nn.Linear(d, head)).eval()


class One(nn.Module):
    """A container holding one GEMM leaf ``gemm``: what ``calibrate.gemm_graph`` describes."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.gemm = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


def gemm_policy(prec: str) -> Policy:
    # ``default: prec`` on a container of one GEMM: the input and weight cast at the GEMM,
    # its output left in ``prec`` — the kernels gemm_graph's plan prices (a rule on the
    # leaf under a fp32 default would also cast the output back, which gemm_graph's op
    # trace does not record).
    return Policy(default=prec)


def policies(model: nn.Module, hidden: list[int], n_random: int, rng: random.Random
             ) -> list[tuple[str, Policy]]:
    """Regions, islands, regions with exceptions, then random mixes of default and rules."""
    leaves = gemm_leaf_paths(model)
    blocks = [str(i) for i in range(len(hidden))]
    narrow = [b for b, h in zip(blocks, hidden, strict=True) if h < 512]
    half = len(leaves) // 2
    out = [(f"default: {p}", Policy(default=p)) for p in PRECS]
    out += [(f"islands: fp32 + {p} per leaf", Policy(default="fp32",
                                                    layers=dict.fromkeys(leaves, p)))
            for p in ("bf16", "fp16")]
    out += [("bf16 + fp32 narrow blocks", Policy(default="bf16",
                                                 layers=dict.fromkeys(narrow, "fp32"))),
            ("bf16 + fp16 second half", Policy(default="bf16",
                                               layers=dict.fromkeys(leaves[half:], "fp16"))),
            ("fp32 + bf16 wide blocks", Policy(default="fp32", layers=dict.fromkeys(
                [b for b in blocks if b not in narrow], "bf16")))]
    cands = leaves + blocks
    for i in range(n_random):
        default = rng.choice(PRECS)
        targets = rng.sample(cands, rng.randint(2, max(2, len(cands) // 2)))
        layers = {p: rng.choice(PRECS) for p in targets}
        out.append((f"random-{i + 1} ({default} + {len(layers)} rules)",
                    Policy(default=default, layers=layers)))
    return out


def microbench_samples(profile, repeats: int, smoke: bool) -> list[Sample]:
    """Single GEMMs per precision, a copy and a tiny add, with their one-op cost models
    (``measure.micro_samples``: the micro-benchmarks ``autoprec tune`` calibrates a local
    target with, at this script's shapes)."""
    shapes = [(512, 512, 2048), (512, 2048, 512), (512, 1024, 1024), (512, 128, 128),
              (512, 64, 64)]
    if smoke:
        shapes = [(32, 64, 64)]

    def run_as(module: nn.Module, pol: Policy) -> Any:
        return apply_policy(module, pol, target="cpu")

    return micro_samples(profile, {p: gemm_policy(p) for p in PRECS}, shapes,
                                   lambda run: timed(run, 2, repeats), run_as,
                                   copy_elems=1 << (13 if smoke else 21))


def measure_profile(repeats: int) -> None:
    """Print the cpu profile's raw figures (how devices.yaml's cpu entry is made)."""
    with torch.no_grad():
        best: dict[str, float] = {}
        for m, k, n in [(512, kk, nn_) for kk in (512, 1024, 2048) for nn_ in (512, 2048, 4096)]:
            one, x = One(k, n).eval(), torch.randn(m, k)
            for prec in PRECS:
                with apply_policy(one, gemm_policy(prec), target="cpu"):
                    t = timed(lambda one=one, x=x: one(x), 2, repeats)
                best[prec] = max(best.get(prec, 0.0), 2 * m * k * n / t)
        # 8 MiB: the size of this model's activations. Larger fresh allocations are mmap'd
        # and page-faulted on every clone (32 MiB clones ran at ~8 GB/s, copy_ at ~54).
        x = torch.randn(1 << 21)
        bw = 2 * 4 * x.numel() / timed(lambda: x.clone(), 2, repeats)
        y = torch.randn(16)
        launch = timed(lambda: y.add(1.0), 5, 50)
        small, xs = One(64, 64).eval(), torch.randn(64, 64)
        tiny = {}
        for prec in PRECS:
            with apply_policy(small, gemm_policy(prec), target="cpu"):
                tiny[prec] = timed(lambda: small(xs), 5, 50)
    # set-up: a 64x64x64 GEMM in 16 bits minus the same in fp32 and its two extra casts
    setup = {p: max(0.0, tiny[p] - tiny["fp32"] - 2 * launch) for p in ("bf16", "fp16")}
    prof = get_profile("cpu")
    print(f"# {cpu_facts()}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"shipped cpu profile: peak_tflops "
          + ", ".join(f"{p} {prof.peak_flops[p] / 1e12:.3g}" for p in PRECS)
          + f"; memory_tbps {prof.memory_bw / 1e12:.3g}; launch_overhead_us "
          f"{prof.launch_overhead_s * 1e6:.3g}")
    print("peak_tflops: {" + ", ".join(f"{p}: {best[p] / 1e12:.3g}" for p in PRECS) + "}")
    print(f"memory_tbps: {bw / 1e12:.3g}")
    print(f"launch_overhead_us: {launch * 1e6:.3g}")
    print("gemm_setup_us: {" + ", ".join(f"{p}: {v * 1e6:.3g}" for p, v in setup.items()) + "}")


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    if len(a) < 3:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def run_fails(model: nn.Module, pol: Policy, x: torch.Tensor) -> str:
    """Run a plan the cost model calls invalid: the error it raises, or "ran"."""
    try:
        with torch.no_grad(), apply_policy(model, pol, target="cpu"):
            model(x)
    except Exception as err:  # the point is to see whether (and how) it fails
        return f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    return "ran"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", type=int, default=7, help="random mixes (plus 8 fixed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="measure the cpu profile and exit")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    ap.add_argument("--out", type=Path, default=None,
                    help="write cost_model_cpu.csv and cpu.calibration.yaml here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # see the module docstring
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    warnings.simplefilter("ignore", PolicyWarning)  # hand-made policies: no fingerprint
    if args.profile:
        measure_profile(args.repeats)
        return 0

    if args.smoke:
        d, hidden, head, batch, seq = 64, [128, 32], 32, 2, 8
        args.policies, args.repeats = min(args.policies, 2), min(args.repeats, 3)
    else:
        # Widths mix GEMMs where AMX bf16 wins (wide) with ones where the low-precision
        # set-up and casts dominate (narrow): the ranking must get both right.
        d, hidden, head, batch, seq = 768, [3072, 128, 1536, 256, 2304, 768], 256, 4, 64
    t_start = time.perf_counter()
    model = build_model(d, hidden, head)
    x = torch.randn(batch, seq, d)
    graph = trace(model, x, tracers=("hooks",))
    profile = get_profile("cpu")
    cm = CostModel(graph, profile)

    t0 = time.perf_counter()
    cal = fit(profile, microbench_samples(profile, args.repeats, args.smoke),
              fit_setup=True, note=f"cost_model_cpu.py micro-benchmarks; {cpu_facts()}; "
                                   f"torch {torch.__version__}, 1 thread")
    cm_cal = cm.with_profile(cal.profile)
    t_cal = time.perf_counter() - t0

    pols = policies(model, hidden, args.policies, rng)
    order = list(range(len(pols)))
    rng.shuffle(order)  # measure in random order: drift does not line up with the list
    measured: dict[int, float] = {}
    failed: dict[int, str] = {}
    with torch.no_grad():
        for i in order:
            name, pol = pols[i]
            if not math.isfinite(cm.estimate(pol)):
                failed[i] = run_fails(model, pol, x)
                continue
            with apply_policy(model, pol, target="cpu"):
                measured[i] = timed(lambda: model(x), 2, args.repeats)

    rows: list[dict[str, Any]] = []
    for i, (name, pol) in enumerate(pols):
        bd = cm.breakdown(pol)
        row: dict[str, Any] = {"policy": name, "default": pol.default, "rules": len(pol.layers),
                               "casts": bd.casts, "weight_casts": bd.weight_casts}
        if i in failed:
            row.update(est_ms=math.inf, invalid=bd.invalid, real_run=failed[i])
        else:
            row.update(measured_ms=measured[i] * 1e3, est_ms=bd.total_s * 1e3,
                       est_cal_ms=cm_cal.estimate(pol) * 1e3,
                       cast_share=bd.parts["cast"] / bd.total_s)
        rows.append(row)
    ok = [r for r in rows if "measured_ms" in r]
    meas = [r["measured_ms"] for r in ok]
    rho = spearman(meas, [r["est_ms"] for r in ok])
    rho_cal = spearman(meas, [r["est_cal_ms"] for r in ok])
    rand = [r for r in ok if r["policy"].startswith("random")]
    rho_rand = spearman([r["measured_ms"] for r in rand], [r["est_ms"] for r in rand])

    lines: list[str] = []
    say = lines.append
    say(f"machine: {cpu_facts()}")
    say(f"torch {torch.__version__}, 1 thread, thread CPU time, median of {args.repeats}; "
          f"model: {len(gemm_leaf_paths(model))} Linear layers in {len(hidden)} blocks, d={d}, "
          f"tokens={batch * seq}; policies applied with target='cpu'")
    w = max(len(r["policy"]) for r in rows)
    hdr = (f"{'policy':<{w}} {'casts':>5} {'w.casts':>7} {'measured ms':>11} {'est ms':>8} "
           f"{'est(cal) ms':>11} {'cast share':>10}")
    say(hdr)
    say("-" * len(hdr))
    for r in rows:
        if "measured_ms" not in r:
            say(f"{r['policy']:<{w}} {r['casts']:>5} {r['weight_casts']:>7}  cannot run "
                  f"(cost model: {r['invalid']}; real run: {r['real_run']})")
            continue
        say(f"{r['policy']:<{w}} {r['casts']:>5} {r['weight_casts']:>7} "
              f"{r['measured_ms']:>11.2f} {r['est_ms']:>8.2f} {r['est_cal_ms']:>11.2f} "
              f"{r['cast_share']:>10.0%}")
    say(f"Spearman(estimate, measured), cpu profile:            {rho:.3f}  "
          f"(random mixes only: {rho_rand:.3f}; {len(ok)} policies)")
    say(f"Spearman(estimate, measured), micro-bench calibrated: {rho_cal:.3f}  "
          f"(fit on {cal.calibration.n_samples} micro-benchmarks in {t_cal:.1f}s, "
          f"rel. RMSE {cal.calibration.rel_rmse:.2f})")
    for key, what in (("est_ms", "cpu profile"), ("est_cal_ms", "calibrated")):
        errs = sorted(abs(r[key] / r["measured_ms"] - 1) for r in ok)
        say(f"|estimate / measured - 1|, {what}: median {errs[len(errs) // 2]:.0%}, "
            f"worst {errs[-1]:.0%}")
    c = cal.calibration
    say("calibrated factors: eff " + ", ".join(f"{p}={v:.2f}" for p, v in c.efficiency.items())
          + f"; mem_eff {c.memory_efficiency or 1.0:.2f}; launch "
          f"{(c.launch_overhead_s or 0) * 1e6:.1f} us; setup "
          + ", ".join(f"{p}={v * 1e6:.0f} us" for p, v in c.gemm_setup_s.items()))
    say(f"wall time {time.perf_counter() - t_start:.0f}s")
    print("\n".join(lines))
    if args.out is not None:
        import pandas as pd

        args.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out / "cost_model_cpu.csv", index=False)
        c.save(args.out / "cpu.calibration.yaml")
        cmd = " ".join(["python -m benchmarks.cost_model_cpu",
                        *(argv if argv is not None else sys.argv[1:])])
        (args.out / "cost_model_cpu.md").write_text(
            f"# cost model vs this CPU\n\nMade by `{cmd}`.\n\n```text\n"
            + "\n".join(lines) + "\n```\n")
        print(f"wrote {args.out / 'cost_model_cpu.csv'}, .md, {args.out / 'cpu.calibration.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
