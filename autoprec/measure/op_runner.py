"""How one recorded op is timed alone: rebuilt from its recipe, run, timed.

``_Runner.seconds(recipe, dtype)`` rebuilds the op's tensors (``_Builder``: each recipe
tensor in the dtype asked for, the batch dimension scaled), cycles its weight operands
through copies spanning the cache they overflow (``_span``) and returns the median thread
CPU time of one call (``_time``). What is timed is ``measure.ops``'s; why so is in
``measure.op_times``'s docs.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from autoprec.trace.ops import OpTrace

#: A sample runs the op this long at least (several calls if one is shorter).
SAMPLE_S = 5e-4
#: Samples per op and pass; passes over all the ops. An op's time is the median of its
#: passes' medians: its samples are spread over the whole measurement, interleaved with
#: every other op's, so a drift (a process warming up, a neighbour's load) shifts all ops
#: alike instead of landing on the few timed while it lasted (docs/cost_history.md).
SAMPLES, PASSES = 3, 3
#: The last-level cache assumed when the OS does not say, and the most believed (a VM's
#: sysfs reported 260 MB on one of the team's machines).
LLC_DEFAULT, LLC_MAX = 32 << 20, 64 << 20


#: The core's L2 assumed when the OS does not say.
L2_DEFAULT = 512 << 10
#: The most copies of one op's weights (a small weight in a large model: 256 x 16 KB).
COPIES_MAX = 256
#: Before its samples, an op whose weight is cycled runs through its copies once (for at
#: most this long), so that each copy sits where the forward leaves a weight, read one
#: footprint earlier, rather than wherever the ops timed before it pushed it
#: (docs/cost_history.md).
CYCLE_S = 0.01


def _cache_bytes() -> dict[int, int]:
    """Data/unified cache sizes by level (sysfs: cpu0's), e.g. {1: 32K, 2: 512K, 3: 32M}."""
    out: dict[int, int] = {}
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            level = int((idx / "level").read_text())
            text = (idx / "size").read_text().strip().upper()
            n = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0)
            out[level] = max(out.get(level, 0), n)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _llc_bytes() -> int:
    """The CPU's last-level cache in bytes (sysfs), at most ``LLC_MAX``."""
    sizes = _cache_bytes()
    return min(max(sizes.values(), default=0) or LLC_DEFAULT, LLC_MAX)


def _span(footprint: int) -> int:
    """Bytes (at fp32's width) a weight operand is cycled through when timed alone: what
    one forward moves between two reads of that weight (``footprint``, ``measure.ops``), at
    most twice the last-level cache; 0 (timed hot) when it fits the core's L2."""
    l2 = _cache_bytes().get(2) or L2_DEFAULT
    return 0 if footprint <= l2 else min(footprint, 2 * _llc_bytes())


# -- rebuilding an op from its recipe ---------------------------------------------------------

def _resolve(name: str) -> Callable[..., Any]:
    if name.startswith("F."):
        return getattr(torch.nn.functional, name[2:])
    _, packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _dense_strides(shape: list[int], stride: list[int]) -> list[int]:
    """Strides of a dense tensor of ``shape`` laid out in ``stride``'s dimension order
    (broadcast dimensions, stride 0, stay 0)."""
    order = sorted(range(len(shape)), key=lambda d: (stride[d], shape[d]))
    out, acc = [0] * len(shape), 1
    for d in order:
        if stride[d] == 0:
            continue
        out[d] = acc
        acc *= max(1, shape[d])
    return out


class _Builder:
    """Tensors for one op call: each recipe tensor in the dtype asked for."""

    def __init__(self, trace: OpTrace, scale: float) -> None:
        self.trace = trace
        self.scale = scale

    def shape(self, spec: dict[str, Any]) -> tuple[list[int], list[int]]:
        shape, stride = list(spec["shape"]), list(spec["stride"])
        v = self.trace.values[spec["t"]]
        if self.scale != 1.0 and v.scales and shape:
            d = spec.get("bdim", 0)  # the batch dimension (0 unless the recipe says)
            n = shape[d] * self.scale
            if abs(n - round(n)) > 1e-9 or round(n) < 1:
                raise ValueError("batch dimension does not scale")
            shape[d] = int(round(n))
            stride = _dense_strides(shape, stride)
        return shape, stride

    def tensor(self, spec: dict[str, Any], dtype: torch.dtype | None) -> torch.Tensor:
        shape, stride = self.shape(spec)
        own = getattr(torch, spec["dt"])
        dt = dtype if dtype is not None and own.is_floating_point else own
        # the storage the strides span, filled, then viewed (a stride-0 broadcast operand,
        # e.g. ``cost.unfolded``'s expanded weight, cannot be filled through its view)
        broadcast = 0 in stride and all(shape)
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
        t = (torch.empty(size, dtype=dt) if broadcast
             else torch.empty_strided(shape, stride, dtype=dt))
        if dt.is_floating_point:
            t.uniform_(0.1, 1.0)  # positive: log, sqrt, division stay finite
        elif dt == torch.bool:
            # masks all true: an SDPA's boolean attn_mask that is false everywhere masks
            # every score, and the CPU flash kernel skips the masked blocks — MiniLM's
            # attention (16 x 12 heads x 15 tokens) took 0.78 ms so, 1.20 ms attending
            t.fill_(True)
        else:
            t.zero_()  # indices in range
        if broadcast:
            return t.as_strided(shape, stride)
        if dt.is_floating_point and self.trace.values[spec["t"]].source == "param":
            # a parameter requires grad, and kernels choose by it: torch's matmul folds a
            # non-contiguous 3-D input into one mm only for such a weight (``should_fold``;
            # nn.MultiheadAttention's in-projection: 0.2 ms folded, 2.7 ms as a bmm in bf16)
            t.requires_grad_(True)
        return t

    def build(self, obj: Any, dtype: torch.dtype | None) -> Any:
        if isinstance(obj, list):
            return [self.build(x, dtype) for x in obj]
        if isinstance(obj, dict):
            if "t" in obj:
                return self.tensor(obj, dtype)
            if "dtype" in obj:
                return getattr(torch, obj["dtype"])
            if "device" in obj:
                return torch.device(obj["device"])
            if "mf" in obj:
                return getattr(torch, obj["mf"])
            if "layout" in obj:
                return getattr(torch, obj["layout"])
            return {k: self.build(v, dtype) for k, v in obj.get("kw", obj).items()}
        return obj


def _tensor_specs(obj: Any) -> Iterable[dict[str, Any]]:
    if isinstance(obj, list):
        for x in obj:
            yield from _tensor_specs(x)
    elif isinstance(obj, dict):
        if "t" in obj:
            yield obj
        else:
            for v in obj.values():
                yield from _tensor_specs(v)


def _floating_specs(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in _tensor_specs([recipe["a"], list(recipe["k"].values())])
            if getattr(torch, s["dt"]).is_floating_point]


def _key(recipe: dict[str, Any], trace: OpTrace) -> str:
    """The recipe without value ids (two ops of the same call share one timing), with
    what decides how its tensors are built: scaled with the batch, a weight."""
    def strip(obj: Any) -> Any:
        if isinstance(obj, list):
            return [strip(x) for x in obj]
        if isinstance(obj, dict):
            if "t" in obj:
                v = trace.values[obj["t"]]
                return {**{k: x for k, x in obj.items() if k != "t"},
                        "s": v.scales, "p": v.source == "param"}
            return {k: strip(x) for k, x in obj.items()}
        return obj
    return json.dumps(strip(recipe), sort_keys=True)


def _time(call: Callable[[], Any], cycle: int = 1) -> float:
    """Seconds of one ``call()``: thread CPU time (``measure_latency``, as tune's timings),
    median of SAMPLES samples of at least SAMPLE_S each (one pass). ``cycle``: the calls
    in one cycle of weight copies, run through once first (within ``CYCLE_S``)."""
    from autoprec.measure.latency import measure_latency

    call()  # warm-up (first-call allocations, oneDNN primitive creation)
    t0 = time.thread_time()
    call()
    one = max(time.thread_time() - t0, 1e-7)
    for _ in range(min(cycle, math.ceil(CYCLE_S / one)) - 2):
        call()
    reps = max(1, min(10_000, math.ceil(SAMPLE_S / one)))

    def sample() -> None:
        for _ in range(reps):
            call()

    return measure_latency(sample, "cpu", warmup=0, repeats=SAMPLES,
                           clock="thread").median_s / reps


class _Runner:
    """Times recipes: weights cycled through ``span`` bytes of copies (0: hot)."""

    def __init__(self, trace: OpTrace, scale: float, span: int) -> None:
        self.trace, self.scale, self.span = trace, scale, span

    def seconds(self, recipe: dict[str, Any], dtype: torch.dtype | None,
                channels_last: bool = False) -> float:
        func = _resolve(recipe["f"])
        builder = _Builder(self.trace, self.scale)
        args = builder.build(recipe["a"], dtype)
        kwargs = {k: builder.build(v, dtype) for k, v in recipe["k"].items()}
        copies = self._weight_copies(recipe, args, kwargs)
        if channels_last:
            args = _channels_last(args)
            copies = [(_channels_last(a), k) for a, k in copies]
        if copies:
            sets = itertools.cycle(copies)

            def call() -> Any:
                a, k = next(sets)
                return func(*a, **k)
        else:
            def call() -> Any:
                return func(*args, **kwargs)
        with torch.no_grad():
            return _time(call, cycle=max(1, len(copies)))

    def _weight_copies(self, recipe: dict[str, Any], args: Any, kwargs: Any
                       ) -> list[tuple[Any, Any]]:
        """Argument sets whose weight tensors span ``span`` bytes (none when hot)."""
        if not self.span:
            return []
        params = [s for s in _tensor_specs([recipe["a"], list(recipe["k"].values())])
                  if self.trace.values[s["t"]].source == "param"]
        if not params:
            return []
        nbytes = sum(math.prod(s["shape"]) for s in params) * 4  # at fp32's width, as span
        n = max(1, min(COPIES_MAX, math.ceil(self.span / max(nbytes, 1))))
        if n == 1:
            return []
        builder = _Builder(self.trace, self.scale)
        want = {id(s) for s in params}
        sets = []
        for _ in range(n):
            def fresh(obj: Any, orig: Any) -> Any:
                if isinstance(obj, list):
                    return [fresh(o, g) for o, g in zip(obj, orig, strict=True)]
                if isinstance(obj, dict) and "t" in obj:
                    if id(obj) in want:
                        return builder.tensor(obj, orig.dtype).to(orig.dtype)
                    return orig
                if isinstance(obj, dict):
                    return {k: fresh(v, orig[k]) for k, v in obj.get("kw", obj).items()}
                return orig
            sets.append((fresh(recipe["a"], args),
                         {k: fresh(v, kwargs[k]) for k, v in recipe["k"].items()}))
        return sets


def _channels_last(obj: Any) -> Any:
    """``obj`` with every 4-D / 5-D tensor in channels-last layout (a convolution's input
    and weight, as inductor's CPU backend lays them out)."""
    if isinstance(obj, list):
        return [_channels_last(x) for x in obj]
    if isinstance(obj, torch.Tensor) and obj.dim() in (4, 5):
        fmt = torch.channels_last if obj.dim() == 4 else torch.channels_last_3d
        return obj.contiguous(memory_format=fmt)
    return obj


__all__ = ["L2_DEFAULT", "LLC_DEFAULT", "LLC_MAX", "PASSES", "SAMPLES", "SAMPLE_S"]
