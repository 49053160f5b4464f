"""Micro-benchmarks run on this machine for ``cost.calibrate.fit``: single GEMMs per
precision, a copy, a tiny add, and the compiled call's own overhead.

Each sample pairs what ran here with the cost model that prices it (``cost.calibrate``'s
single-op graphs), so ``fit`` can solve the profile's efficiency factors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from autoprec.cost.calibrate import Sample, copy_graph, gemm_graph
from autoprec.cost.model import CostModel
from autoprec.cost.profiles import DeviceProfile
from autoprec.policy.schema import Policy

# --- micro-benchmarks: single GEMMs per precision, a copy, a tiny add -----------------

#: GEMM shapes (m, k, n) a CPU calibration times: from attention-sized (256 rows, widths
#: 384 / 1536, MiniLM's) to 1024-wide, and narrow ones where the 16-bit set-up and the
#: casts dominate. About a second per precision on one thread.
CPU_SHAPES = ((256, 384, 384), (256, 384, 1536), (256, 1536, 384), (512, 1024, 1024),
              (512, 2048, 512), (256, 128, 128), (64, 64, 64))
#: 8 MiB of fp32: a CPU's activations fit its L3; larger fresh allocations are mmap'd and
#: page-faulted on every clone (benchmarks/cost_model_cpu.py measure_profile).
CPU_COPY_ELEMS = 1 << 21


def gpu_shapes(d: int, tokens: int) -> tuple[tuple[int, int, int], ...]:
    """A transformer's GEMMs at width ``d`` and ``tokens`` rows, plus small-batch ones."""
    return tuple(sorted({(tokens, d, d), (tokens, d, 3 * d), (tokens, d, 4 * d),
                         (tokens, 4 * d, d), (max(16, tokens // 16), d, d),
                         (max(16, tokens // 256), d, 4 * d)}))


def micro_samples(
    profile: DeviceProfile,
    plans: Mapping[str, Policy],
    shapes: Sequence[tuple[int, int, int]],
    timer: Callable[[Callable[[], Any]], float],
    run_as: Callable[[Any, Policy], AbstractContextManager[Any]],
    *,
    device: str = "cpu",
    copy_elems: int = CPU_COPY_ELEMS,
    compile: bool = False,
    call_overhead_s: float = 0.0,
) -> list[Sample]:
    """Micro-benchmark samples for ``fit``: one GEMM per shape and plan, a copy, a tiny add.

    Each GEMM runs as autoprec runs it: ``run_as(module, plan)`` (``apply_policy``; passed
    in, the cost stage does not apply) around a container holding one bias-free Linear
    ``gemm``. ``plans`` maps a label to the plan: ``default: prec`` casts the input and the
    weight at the GEMM and leaves the output in ``prec`` — the kernels ``gemm_graph``'s
    plan prices; fp8 is a rule under ``default: bf16``. ``timer(run)`` returns seconds.

    ``compile``: every micro-benchmark runs ``torch.compile``'d (after ``run_as``), is
    priced by ``CostModel(..., mode="compile")`` and has ``call_overhead_s`` (``call_overhead``: the
    compiled call's own time, priced per forward apart from the kernels) taken off.
    """
    import torch

    def ready(call: Callable[[Any], Any], fn: Any) -> Callable[[], Any]:
        """``call(fn)`` as a run of no arguments; with ``compile``, ``fn`` compiled (now)."""
        if compile:
            torch._dynamo.reset()
            fn = torch.compile(fn)
            call(fn)  # compiles
        return lambda: call(fn)

    def seconds(run: Callable[[], Any], best_of: int = 1) -> float:
        t = min(timer(run) for _ in range(best_of))
        return max(t - call_overhead_s, 0.1 * t) if compile else t

    mode = "compile" if compile else "eager"
    out = []
    with torch.no_grad():
        for m, k, n in shapes:
            one = torch.nn.Sequential()
            one.add_module("gemm", torch.nn.Linear(k, n, bias=False, device=device))
            one.eval()
            x = torch.randn(m, k, device=device)
            cm = CostModel(gemm_graph(m, k, n), profile, mode=mode)
            for label, pol in plans.items():
                with run_as(one, pol):
                    t = seconds(ready(lambda mod, x=x: mod(x), one))
                out.append(Sample(cm, pol, t, f"gemm {m}x{k}x{n} {label}"))
            del one, x
        x = torch.randn(copy_elems, device=device)
        # the one sample that pins the memory bandwidth: the best of three, since one
        # timing of a fresh 8 MiB output was seen 5x slow (page faults of a new mapping,
        # or a busy neighbour), which priced every weight cast 4x dear
        out.append(Sample(CostModel(copy_graph(copy_elems), profile, mode=mode), {},
                          seconds(ready(lambda f: f(x), torch.clone), best_of=3),
                          f"copy {copy_elems}"))
        y = torch.randn(16, device=device)
        out.append(Sample(CostModel(copy_graph(16), profile, mode=mode), {},
                          seconds(ready(lambda f: f(y, 1.0), torch.add)), "tiny add"))
    if compile:
        torch._dynamo.reset()
    return out


def call_overhead(timer: Callable[[Callable[[], Any]], float], device: str = "cpu") -> float:
    """Seconds a ``torch.compile``'d forward spends outside its kernels (dynamo's guards,
    the compiled wrapper's Python): the intercept of compiled chains of 1 and 8 pairs of a
    tiny (4 x 4) GEMM and a scale, whose kernels cost almost nothing."""
    import torch

    def chain(k: int) -> Callable[[Any], Any]:
        ws = [torch.randn(4, 4, device=device) for _ in range(k)]

        def run(x: Any) -> Any:
            for w in ws:
                x = (x @ w) * 0.5
            return x
        return run

    x = torch.randn(4, 4, device=device)
    t = {}
    with torch.no_grad():
        for k in (1, 8):
            torch._dynamo.reset()
            compiled = torch.compile(chain(k))
            compiled(x)  # compiles
            t[k] = timer(lambda c=compiled: c(x))
        torch._dynamo.reset()
    pair = max(0.0, (t[8] - t[1]) / 7)
    return max(0.0, t[1] - pair)


__all__ = ["CPU_COPY_ELEMS", "CPU_SHAPES", "call_overhead", "gpu_shapes", "micro_samples"]
