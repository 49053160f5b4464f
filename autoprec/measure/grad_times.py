"""The gradient GEMMs of a training step timed on this CPU: each recorded GEMM's dgrad and
wgrad, and each fused attention's backward, per precision, as autograd runs them.

The step price (``cost.step.StepPart``) once priced a gradient GEMM at its forward GEMM's measured time (dgrad and
wgrad have the forward's FLOPs). That holds where the CPU has a real kernel for the dtype;
it does not where it has none: on an AMD EPYC with AVX512-BF16 (no AVX512-FP16), fp16
matmuls run a reference loop whose speed depends on the operands' layout, and the
backward's layouts are the forward's transposed. A Linear of GPT-2's shape (1024 rows,
256 -> 768) took, one thread: fp32 5.4 / 4.4 / 4.4 ms (forward / dgrad / wgrad), bf16
2.0 / 2.1 / 2.3 ms, fp16 26.7 / 128.5 / 59.2 ms. So for a local CPU target each distinct
GEMM is rebuilt from its recipe (``op_runner._Builder``), its forward run with grad, and
``torch.autograd.grad`` of its output timed for the activation operand (dgrad) and for
the weight (wgrad) apart, in each precision, with its operands in that dtype (what
autocast feeds it). Timed as ``cost.op_times`` times an op (one thread, thread CPU time,
median of interleaved passes); weights hot (the backward reads a weight the forward read
one backward-layer earlier). Cached beside the op times (``grads-<digest>.json``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoprec.io.fileio import atomic_write
from autoprec.measure.op_runner import PASSES, _Builder, _key, _resolve, _tensor_specs, _time
from autoprec.measure.ops import DTYPES  # the dtypes an op is timed in: one map
from autoprec.trace.ops import OpTrace

#: Bump when what is timed or how changes.
VERSION = 2
#: (op index) -> {"dgrad" | "wgrad": {precision: seconds}}
GradTimes = dict[int, dict[str, dict[str, float]]]


def _grad_calls(trace: OpTrace, recipe: dict[str, Any], dtype: torch.dtype, scale: float,
                op_kind: str = "gemm") -> dict[str, Any]:
    """{"dgrad": call, "wgrad": call} of one GEMM recipe in ``dtype`` (those it has); of an
    attention recipe, {"dgrad": its backward}."""
    func = _resolve(recipe["f"])
    b = _Builder(trace, scale)
    args = b.build(recipe["a"], dtype)
    kwargs = {k: b.build(v, dtype) for k, v in recipe["k"].items()}
    specs = list(_tensor_specs([recipe["a"], list(recipe["k"].values())]))
    built = [t for t in _flat([args, list(kwargs.values())]) if isinstance(t, torch.Tensor)]
    acts, weights = [], []
    for s, t in zip(specs, built, strict=False):
        if not t.is_floating_point() or len(s["shape"]) < 2:
            continue  # a bias: its gradient is a reduction, priced apart
        if op_kind == "attention" and len(acts) == 3:
            continue  # q, k, v; a floating mask needs no gradient
        if trace.values[s["t"]].source == "param":
            weights.append(t)
        else:
            t.requires_grad_(True)
            acts.append(t)
    out = func(*args, **kwargs)
    dy = torch.empty_like(out).uniform_(0.1, 1.0)
    calls = {}
    if op_kind == "attention":  # SDPA: one backward kernel for q, k and v together
        return {"dgrad": lambda: torch.autograd.grad(out, acts[:3], dy, retain_graph=True)}
    for part, wrt in (("dgrad", acts[:1]), ("wgrad", weights[:1])):
        if wrt:
            calls[part] = (lambda wrt=wrt: torch.autograd.grad(out, wrt, dy, retain_graph=True))
    return calls


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _flat(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in _flat(o)]
    return [obj]


def measure_grads(trace: OpTrace, batch_size: int, precisions: Iterable[str]) -> GradTimes:
    """dgrad and wgrad seconds of every Linear / conv / matmul of ``trace`` with a recipe,
    and the backward of every fused attention ("dgrad"), in fp32 and ``precisions`` (the caller holds torch at the timing threads)."""
    scale = batch_size / trace.batch_size
    precs = [p for p in DTYPES if p == "fp32" or p in set(precisions)]
    distinct: dict[tuple[str, str], Any] = {}
    uses: list[tuple[int, str, tuple[str, str]]] = []
    for i, op in enumerate(trace.ops):
        if op.kind not in ("gemm", "attention") or op.recipe is None:
            continue
        key = _key(op.recipe, trace)
        for p in precs:
            distinct.setdefault((key, p), (op.recipe, op.kind))
            uses.append((i, p, (key, p)))
    calls: dict[tuple[str, str], dict[str, Any]] = {}
    for k, (recipe, kind) in distinct.items():
        try:
            calls[k] = _grad_calls(trace, recipe, DTYPES[k[1]], scale, kind)
        except Exception:  # noqa: BLE001 - a GEMM that cannot run alone keeps the forward's
            continue
    samples: dict[tuple[tuple[str, str], str], list[float]] = {}
    for _ in range(PASSES):
        for k, parts in calls.items():
            for part, call in parts.items():
                samples.setdefault((k, part), []).append(_time(call))
    out: GradTimes = {}
    for i, p, k in uses:
        for part in ("dgrad", "wgrad"):
            got = samples.get((k, part))
            if got:
                out.setdefault(i, {}).setdefault(part, {})[p] = float(np.median(got))
    return out


def cached_or_measured_grads(trace: OpTrace, batch_size: int, cache_dir: Path, digest: str,
                             precisions: Iterable[str], measure_now: bool) -> GradTimes | None:
    """The gradient timings of the trace whose op times have ``digest``, from the cache;
    else, with ``measure_now``, measured and cached; else None."""
    path = Path(cache_dir) / f"grads-{digest}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == VERSION:
                return {int(i): v for i, v in data["grads"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if not measure_now:
        return None
    t0 = time.perf_counter()
    got = measure_grads(trace, batch_size, precisions)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"version": VERSION, "seconds": time.perf_counter() - t0,
                                   "grads": {str(i): v for i, v in got.items()}}))
    return got


__all__ = ["GradTimes", "cached_or_measured_grads", "measure_grads"]
