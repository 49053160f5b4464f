"""What applying a policy costs over the bare model / one global autocast (eager forward).

A 100-layer model (100 Linear + ReLU). Rows:

- all-fp32 policy vs the bare model: one wrapper (the root);
- uniform-bf16 policy (``default: bf16``) vs one global ``torch.autocast``: one wrapper;
- worst cases, for scale: a wrapper on every layer (fp32 islands under a bf16 default:
  the same fp32 arithmetic, 101 wrappers) vs bare; every layer its own bf16 rule under a
  fp32 default vs a global autocast (101 wrappers, plus each island's exit cast to fp32,
  a real activation pass that also runs on a GPU).

Target on GPU: <= 1.03 for the first two rows. On the CPUs here, fp16/bf16 matmuls run
~90x slower than fp32 (no AVX-512/AMX; DESIGN.md), so the bf16 rows use a small width;
CPU ratios only say how much Python the wrappers add per call.

    .venv/bin/python experiments/apply_overhead.py [--width 256] [--bf16-width 32]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.policy import Policy, PolicyWarning

LAYERS = 100


def model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(LAYERS):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).eval()


def linear_paths(m: nn.Module) -> list[str]:
    return [p for p, mod in m.named_modules() if isinstance(mod, nn.Linear)]


def timed(fn: Callable[[], object], iters: int) -> float:
    # CPU time of this thread (torch runs single-threaded here, see main): other
    # processes time-slicing the cores do not inflate it, as they do wall time.
    t = time.thread_time()
    for _ in range(iters):
        fn()
    return (time.thread_time() - t) / iters


def _wall(fn: Callable[[], object], iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def compare(name: str, m: nn.Module, x: torch.Tensor, base_ctx: Callable[[], object],
            policy: Policy, iters: int, repeats: int) -> tuple[str, float, float, float]:
    """Best per-forward seconds of the baseline and the policy, measured interleaved in
    alternating order: on a shared machine, noise only ever adds time, so the minimum is
    the estimate least disturbed by other processes."""

    def base() -> object:
        with base_ctx():
            return m(x)

    b, p = [], []
    with torch.no_grad():
        timed(base, 3)  # warm-up (allocator, oneDNN primitives)
        for r in range(repeats):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                if which == 0:
                    b.append(timed(base, iters))
                else:
                    with apply_policy(m, policy):
                        timed(lambda: m(x), 1)
                        p.append(timed(lambda: m(x), iters))
    tb, tp = min(b), min(p)
    return name, tb, tp, tp / tb


def wrapper_cost(iters: int = 3000, repeats: int = 7) -> list[tuple[str, float]]:
    """Microseconds one wrapper adds per call: a wrapped Identity vs a bare one."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    m = Two()
    x = torch.randn(4, 4)
    cases = [("fp32 region (root wrapper)", Policy(default="fp32")),
             ("bf16 region (root wrapper)", Policy(default="bf16")),
             ("bf16 island in fp32 (+ exit-cast check)", Policy(layers={"inner": "bf16"})),
             ("fp32 island in bf16 (+ input upcast)", Policy(default="bf16",
                                                          layers={"inner": "fp32"}))]
    out = []
    with torch.no_grad():
        bare = min(timed(lambda: m(x), iters) for _ in range(repeats))
        for name, pol in cases:
            with apply_policy(m, pol):
                t = min(timed(lambda: m(x), iters) for _ in range(repeats))
            out.append((name, (t - bare) * 1e6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256, help="fp32 rows: Linear width")
    ap.add_argument("--batch", type=int, default=32, help="rows of the input")
    ap.add_argument("--bf16-width", type=int, default=32, help="bf16 rows: Linear width")
    ap.add_argument("--iters", type=int, default=10, help="forwards per measurement")
    ap.add_argument("--repeats", type=int, default=10, help="measurements (minimum)")
    ap.add_argument("--wall", action="store_true",
                    help="wall time with all threads (on a quiet machine or a GPU host)")
    args = ap.parse_args()
    if args.wall:
        global timed
        timed = _wall
    else:
        torch.set_num_threads(1)
    warnings.simplefilter("ignore", PolicyWarning)  # hand-made policies: no fingerprint

    rows = []
    m = model(args.width)
    x = torch.randn(args.batch, args.width)
    islands = {p: "fp32" for p in linear_paths(m)}
    rows.append(compare("all-fp32 policy / bare model", m, x, nullcontext,
                        Policy(default="fp32"), args.iters, args.repeats))
    rows.append(compare("fp32 islands on all 100 layers / bare model", m, x, nullcontext,
                        Policy(default="bf16", layers=islands), args.iters, args.repeats))

    mb = model(args.bf16_width)
    xb = torch.randn(args.batch, args.bf16_width)
    bf16 = {p: "bf16" for p in linear_paths(mb)}

    def autocast() -> object:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    rows.append(compare("uniform-bf16 policy / global autocast", mb, xb, autocast,
                        Policy(default="bf16"), args.iters, args.repeats))
    rows.append(compare("bf16 rule on each of 100 layers / global autocast", mb, xb,
                        autocast, Policy(default="fp32", layers=bf16), args.iters,
                        args.repeats))

    clock = "wall time" if args.wall else "thread CPU time"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock}, {LAYERS} "
          f"layers, "
          f"batch {args.batch}; fp32 width {args.width}, bf16 width {args.bf16_width}; "
          f"best of {args.repeats} x {args.iters} eager forwards, interleaved")
    w = max(len(r[0]) for r in rows)
    print(f"{'comparison':<{w}}  {'baseline ms':>11}  {'policy ms':>9}  {'ratio':>6}")
    for name, tb, tp, ratio in rows:
        print(f"{name:<{w}}  {tb * 1e3:>11.3f}  {tp * 1e3:>9.3f}  {ratio:>6.3f}")
    print("target on GPU: ratio <= 1.03 for the first and third rows (one wrapper each)")
    print()
    print("per call, over the bare module (an Identity, so only the wrapper is timed):")
    for name, us in wrapper_cost():
        print(f"  {name:<42} {us:7.1f} us")


if __name__ == "__main__":
    main()
