"""What is timed of a recorded forward: every op in each precision it may run in, every
cast a plan may insert, a module call and apply's wrapper around one (``measure``), and
the batched GEMM inductor runs for a Linear it does not fold (``cost.unfolded``).

Each is timed alone by ``op_runner``; the result is an ``OpTimes`` (``op_times_record``),
cached by ``measure.op_times``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from autoprec.cost.op_times_record import OpTimes, cast_key
from autoprec.cost.unfolded import unfolded_gemms
from autoprec.measure.op_runner import (
    PASSES,
    _floating_specs,
    _key,
    _Runner,
    _span,
    _time,
)
from autoprec.trace.ops import Op, OpTrace

#: Floating dtypes an op is timed in (the names of the plan stage).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The kinds timed per compute precision (the rest per input dtype).
COMPUTE_KINDS = ("gemm", "attention")
#: Variant prefix of a convolution timed in channels-last layout (``OpTimes.compute_cl``).
CL = "cl:"
#: Variant prefix of the unfolded ``bmm`` timed with its weight hot (``OpTimes.compute_unfolded``).
HOT = "hot:"
#: Recipe functions that are convolutions (timed in both layouts).
_CONVS = frozenset({"F.conv1d", "F.conv2d", "F.conv3d", "aten.convolution.default",
                    "aten.conv2d.default", "aten.conv3d.default"})


def is_conv(op: Op) -> bool:
    """A convolution with a 4-D or 5-D input: inductor's CPU backend runs it channels-last."""
    r = op.recipe
    if r is None or r.get("f") not in _CONVS or not r.get("a"):
        return False
    first = r["a"][0]
    return isinstance(first, dict) and len(first.get("shape", ())) in (4, 5)


def _module_call_s() -> float:
    """One ``nn.Module.__call__`` of a trivial module, beyond the call of its forward."""
    m = torch.nn.Identity()
    x = torch.zeros(1)
    return max(0.0, _time(lambda: m(x)) - _time(lambda: m.forward(x)))


def _wrapper_s() -> dict[str, float]:
    """Per form, the host seconds apply's wrapper adds to one module call: a bf16 region
    (train: ``lower.forward.lowered_forward``, an autocast block) or stored bf16 inputs
    (deploy: ``lower.stored.deploy_forward``, autocast off) around a trivial forward."""
    from autoprec.lower.forward import lowered_forward
    from autoprec.lower.stored import deploy_forward

    plain = torch.nn.Identity()
    out = {}
    for form, x in (("train", torch.zeros(2, 4)), ("deploy", torch.zeros(2, 4, dtype=torch.bfloat16))):
        m = torch.nn.Identity()
        m.forward = (lowered_forward(m, "bf16") if form == "train"  # type: ignore[method-assign]
                     else deploy_forward(m, "bf16"))
        with torch.no_grad():
            out[form] = max(0.0, _time(lambda m=m, x=x: m(x)) - _time(lambda x=x: plain(x)))
    return out


def _footprint(trace: OpTrace, scale: float) -> int:
    """Bytes one forward moves between two reads of the same weight: every parameter and
    every op's output once, at fp32's width, at the timed batch (views move nothing)."""
    vals = trace.values
    n = sum(v.numel for v in vals if v.source == "param")
    for op in trace.ops:
        if op.kind != "view":
            n += sum(vals[o].numel * (scale if vals[o].scales else 1.0) for o in op.outputs)
    return int(4 * n)


def _variants(op: Op, floating: bool, precisions: Iterable[str]) -> list[str]:
    """What op is timed as: each dtype (``DTYPES``; a GEMM's only in ``precisions``), a
    convolution also channels-last (``CL``)."""
    if not floating:
        return ["-"]
    out = [p for p in DTYPES if op.kind not in COMPUTE_KINDS or p in precisions]
    return out + [CL + p for p in out] if is_conv(op) else out


def measure(trace: OpTrace, batch_size: int, *, precisions: Iterable[str] = DTYPES,
            machine: str = "", progress: Callable[[int, int], None] | None = None) -> OpTimes:
    """Time every op of ``trace`` with a recipe, its casts and a module call, on this CPU
    at ``batch_size`` (the caller holds torch at the timing threads).

    A weight operand is read cold: the forward moved everything else since its last read,
    so it is cycled through copies spanning that footprint (``_footprint``,
    ``op_runner._span``). The training form's 16-bit GEMM reads the cast of its master it
    has just written, and is priced at the same cold timing (docs/cost_history.md).
    Only the unfolded ``bmm`` (which runs only where the weight is cast) is timed hot."""
    t_start = time.perf_counter()
    precisions = set(precisions) | {"fp32"}
    scale = batch_size / trace.batch_size
    span = _span(_footprint(trace, scale))
    runners = {False: (_Runner(trace, scale, span), _Runner(trace, 1.0, span)),
               True: (_Runner(trace, scale, 0), _Runner(trace, 1.0, 0))}
    out = OpTimes(batch_size, machine=machine)
    # every op -> its distinct (recipe key, variant) timings; each distinct one timed once
    uses: list[tuple[int, dict[int, dict[str, float]], str, tuple[str, str]]] = []
    distinct: dict[tuple[str, str], dict[str, Any]] = {}
    for i, op in enumerate(trace.ops):
        if op.recipe is None:
            continue
        key = _key(op.recipe, trace)
        table = out.compute if op.kind in COMPUTE_KINDS else out.other
        for var in _variants(op, bool(_floating_specs(op.recipe)), precisions):
            distinct.setdefault((key, var), op.recipe)
            cl = var.startswith(CL)
            uses.append((i, out.compute_cl if cl else table, var.removeprefix(CL), (key, var)))
    for i, recipe in unfolded_gemms(trace).items():  # the bmm inductor runs instead
        key = _key(recipe, trace)
        for var in _variants(trace.ops[i], True, precisions):
            distinct.setdefault((key, HOT + var), recipe)  # its weight is a fresh cast
            uses.append((i, out.compute_unfolded, var, (key, HOT + var)))
    passes: dict[tuple[str, str], list[float] | None] = {k: [] for k in distinct}
    for p in range(PASSES):  # interleaved passes (see SAMPLES, PASSES)
        for n, (k, recipe) in enumerate(distinct.items()):
            got = passes[k]
            if got is not None:
                hot, var = k[1].startswith(HOT), k[1].removeprefix(HOT)
                one = _try(*runners[hot], recipe, DTYPES.get(var.removeprefix(CL)), scale,
                           channels_last=var.startswith(CL))
                passes[k] = None if one is None else [*got, one]
            if progress is not None:
                progress(p * len(distinct) + n + 1, PASSES * len(distinct))
    done = {k: float(np.median(v)) for k, v in passes.items() if v}
    for i, table, var, k in uses:
        if k in done:
            table.setdefault(i, {})[var] = done[k]
    out.distinct = len(done)
    out.casts = _cast_times(trace, scale)
    out.module_call_s = _module_call_s()
    out.wrapper_s = _wrapper_s()
    out.seconds = time.perf_counter() - t_start
    return out


def _try(runner: _Runner, linear: _Runner, recipe: dict[str, Any], dtype: torch.dtype | None,
         scale: float, channels_last: bool = False) -> float | None:
    """Seconds of the recipe at the cost model's batch; at the recorded batch scaled
    linearly when it does not rebuild there; None when it does not run alone."""
    try:
        return runner.seconds(recipe, dtype, channels_last)
    except Exception:  # noqa: BLE001 - any op that cannot run alone is priced by roofline
        if scale == 1.0:
            return None
    try:
        return linear.seconds(recipe, dtype, channels_last) * scale
    except Exception:  # noqa: BLE001
        return None


def _cast_times(trace: OpTrace, scale: float) -> dict[str, float]:
    """One cast of every floating value's size, between fp32, bf16 and fp16.

    A weight's cast (the training form casts each master weight on every call) reads a
    tensor the forward last touched one forward earlier, after moving everything else it
    moves: where that footprint (``_footprint``) overflows L2, weights are cycled through
    copies spanning it, else timed hot like every other cast. Measured on an AMD EPYC
    (AVX512-BF16, 1 MB L2 per core): inside the bf16 forwards of examples/nn_transformer
    and encoder4, a 768 x 192 weight's cast took 29-35 us against 14-22 us back to back;
    cycled through 5 / 18 / 71 MB of copies, 14 / 24 / 30 us."""
    span = _span(_footprint(trace, scale))
    sizes: set[tuple[int, bool]] = set()
    for v in trace.values:
        if v.dtype in DTYPES and v.numel > 0:
            weight = v.source == "param"
            n = v.numel if weight or not v.scales else int(round(v.numel * scale))
            sizes.add((max(1, n), weight and span > 0))
    out: dict[str, float] = {}
    for n, weight in sorted(sizes):
        for src, sdt in DTYPES.items():
            copies = max(1, min(256, math.ceil(span / (n * 4)))) if weight else 1
            xs = [torch.empty(n, dtype=sdt).uniform_(0.1, 1.0) for _ in range(copies)]
            for dst, ddt in DTYPES.items():
                if dst == src:
                    continue
                it = itertools.cycle(xs)
                out[cast_key(n, src, dst, weight)] = _time(
                    lambda it=it, ddt=ddt: next(it).to(ddt))
    return out


__all__ = ["COMPUTE_KINDS", "DTYPES", "is_conv", "measure"]
