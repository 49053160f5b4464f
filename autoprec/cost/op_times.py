"""The model's own ops timed on this machine: what a local CPU target is priced with.

A profile fitted on ~25 micro-benchmarks (``cost.calibrate``) prices every op by a roofline
of FLOPs and bytes. On a CPU that misses what the model runs besides its GEMMs — the
dispatch of every aten op and view, norms, softmax and activations that are no faster in
16 bits, the 16-bit GEMMs' own shapes — and the estimate was off by up to +54 % against
tune's own timing (issue 29). So for a local CPU target the recorded forward
(``trace.ops``: every op with its recipe, ``Op.recipe``) is run here op by op:

- every distinct op (same function, shapes, strides, dtypes and arguments) once per
  precision it may run in: a GEMM / SDPA / conv with its floating operands in fp32, bf16
  and fp16 (what it computes in), every other op with its floating inputs in each dtype;
- every convolution once more per precision in channels-last layout (``compute_cl``), the
  layout inductor's CPU backend gives every convolution of a graph (``torch._inductor
  .graph.decide_layout_opt``: with oneDNN, always): the digits CNN's bf16 ``conv2``
  (16 -> 32 channels, 64 x 8 x 8) took 20.6 ms NCHW and 8.8 ms channels-last on an AVX2
  EPYC, and its compiled 16-bit rows were estimated 30-46 % too slow;
- every cast a plan may insert: each floating value's size, fp32 <-> bf16 <-> fp16;
- the host's cost of one module call (``nn.Module.__call__`` around a trivial forward),
  paid by every plan once per recorded call, and of apply's wrapper around one (per form),
  paid per call of a module the plan wraps.

Each is timed as tune times a model (``search.timing``): one torch thread, the thread's CPU
time, the median of ``SAMPLES`` samples of at least ``SAMPLE_S`` each, after a warm-up.
Inputs are rebuilt from the recipe (``uniform_`` values, integer tensors zero). An op
timed alone finds its weight in the core's L2 cache, where the model's forward, running
every layer in turn, finds it only if all the weights fit there: a model whose weights
exceed L2 reads them from L3 on every forward, one that exceeds the last-level cache from
memory. So the weight operands (and weight casts) of such a model are cycled through
copies spanning twice that cache (``_span``): on this team's AMD EPYC a 256 x 256 fp32
Linear at 64 rows took 145 us alone and 200 us with its weight cycled through 18 copies,
as in a model of 18 such layers.

The result (``OpTimes``) is cached per op set, batch size and machine under
``<calibration dir>/ops-<digest>.json``: the first tune of a model pays seconds
(experiments/estimate_accuracy.py states it), later ones read the file. An op without a
recipe, or whose recipe cannot run alone, is priced by the calibrated roofline as before.
The batch: recipes are recorded at the calibration batch; a cost model at another batch
size rebuilds each tensor that scales with the batch with its leading dimension scaled
(an op that then fails is timed at the recorded batch and scaled linearly).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoprec.fileio import atomic_write
from autoprec.trace.ops import Op, OpTrace

#: Bump when what is measured or how changes: older cache files are then ignored.
VERSION = 4
#: A sample runs the op this long at least (several calls if one is shorter).
SAMPLE_S = 5e-4
#: Samples per op and pass; passes over all the ops. An op's time is the median of its
#: passes' medians: its samples are spread over the whole measurement, interleaved with
#: every other op's, so a drift (a process warming up, a neighbour's load) shifts all ops
#: alike instead of landing on the few timed while it lasted. Timed in one pass of 7, the
#: same 256 x 256 Linear at 32 rows (experiments/trap) took 53-107 us fp32 and 43-78 us
#: bf16 from one measurement to the next, and the model's bf16 estimate moved 0.98-1.41x.
SAMPLES, PASSES = 3, 3
#: Floating dtypes an op is timed in (the names of the plan stage).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The kinds timed per compute precision (the rest per input dtype).
COMPUTE_KINDS = ("gemm", "attention")
#: Variant prefix of a convolution timed in channels-last layout (``OpTimes.compute_cl``).
CL = "cl:"
#: Recipe functions that are convolutions (timed in both layouts).
_CONVS = frozenset({"F.conv1d", "F.conv2d", "F.conv3d", "aten.convolution.default",
                    "aten.conv2d.default", "aten.conv3d.default"})
#: The last-level cache assumed when the OS does not say, and the most believed (a VM's
#: sysfs reported 260 MB on one of the team's machines).
LLC_DEFAULT, LLC_MAX = 32 << 20, 64 << 20


#: The core's L2 assumed when the OS does not say.
L2_DEFAULT = 512 << 10


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


def _span(weight_bytes: int) -> int:
    """Bytes the weight operands of a model holding ``weight_bytes`` are cycled through
    when timed alone: twice the cache they overflow (0: they fit L2, timed hot)."""
    l2 = _cache_bytes().get(2) or L2_DEFAULT
    llc = _llc_bytes()
    if weight_bytes > llc:
        return 2 * llc
    if weight_bytes > l2:
        return 2 * l2
    return 0


def cast_key(numel: int, src: str, dst: str, weight: bool = False) -> str:
    return f"{numel}:{src}>{dst}{':w' if weight else ''}"


@dataclass
class OpTimes:
    """Seconds of each recorded op on this machine at ``batch_size`` (see module docs).

    ``compute[i][p]``: GEMM/SDPA op ``i`` computing in precision ``p``; ``compute_cl[i][p]``:
    the same for a convolution with its input and weight channels-last; ``other[i][d]``:
    any other op (views included) with its floating inputs in dtype ``d`` ("-": it has
    none); ``casts[cast_key(...)]``: one cast; ``module_call_s``: one module call.
    """

    batch_size: int
    compute: dict[int, dict[str, float]] = field(default_factory=dict)
    other: dict[int, dict[str, float]] = field(default_factory=dict)
    casts: dict[str, float] = field(default_factory=dict)
    module_call_s: float = 0.0
    seconds: float = 0.0  # what measuring took
    distinct: int = 0  # distinct (op, dtype) timings
    machine: str = ""
    digest: str = ""
    cached: bool = False  # read from the cache (not measured by this process)
    wrapper_s: dict[str, float] = field(default_factory=dict)  # per form, one wrapped call
    compute_cl: dict[int, dict[str, float]] = field(default_factory=dict)

    def cast_s(self, numel: int, src: str, dst: str, weight: bool = False) -> float | None:
        got = self.casts.get(cast_key(numel, src, dst, weight))
        if got is None and weight:
            got = self.casts.get(cast_key(numel, src, dst))
        return got

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "batch_size": self.batch_size,
                "compute": {str(k): v for k, v in self.compute.items()},
                "other": {str(k): v for k, v in self.other.items()},
                "casts": self.casts, "module_call_s": self.module_call_s,
                "wrapper_s": self.wrapper_s,
                "compute_cl": {str(k): v for k, v in self.compute_cl.items()},
                "seconds": self.seconds, "distinct": self.distinct,
                "machine": self.machine, "digest": self.digest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpTimes:
        return cls(int(data["batch_size"]),
                   {int(k): v for k, v in data["compute"].items()},
                   {int(k): v for k, v in data["other"].items()},
                   dict(data["casts"]), float(data["module_call_s"]),
                   float(data.get("seconds", 0.0)), int(data.get("distinct", 0)),
                   str(data.get("machine", "")), str(data.get("digest", "")),
                   wrapper_s={str(k): float(v) for k, v in data.get("wrapper_s", {}).items()},
                   compute_cl={int(k): v for k, v in data.get("compute_cl", {}).items()})

    def describe(self) -> str:
        return (f"{len(self.compute) + len(self.other)} ops ({self.distinct} distinct "
                f"timings) and {len(self.casts)} casts timed here in {self.seconds:.1f}s"
                + (" (cached)" if self.cached else ""))


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
            n = shape[0] * self.scale
            if abs(n - round(n)) > 1e-9 or round(n) < 1:
                raise ValueError("batch dimension does not scale")
            shape[0] = int(round(n))
            stride = _dense_strides(shape, stride)
        return shape, stride

    def tensor(self, spec: dict[str, Any], dtype: torch.dtype | None) -> torch.Tensor:
        shape, stride = self.shape(spec)
        own = getattr(torch, spec["dt"])
        dt = dtype if dtype is not None and own.is_floating_point else own
        t = torch.empty_strided(shape, stride, dtype=dt)
        if dt.is_floating_point:
            t.uniform_(0.1, 1.0)  # positive: log, sqrt, division stay finite
        else:
            t.zero_()  # indices in range, masks all false
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


def _time(call: Callable[[], Any]) -> float:
    """Seconds of one ``call()``: thread CPU time (``measure_latency``, as tune's timings),
    median of SAMPLES samples of at least SAMPLE_S each (one pass)."""
    from autoprec.cost.measure import measure_latency

    call()  # warm-up (first-call allocations, oneDNN primitive creation)
    t0 = time.thread_time()
    call()
    one = max(time.thread_time() - t0, 1e-7)
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
            return _time(call)

    def _weight_copies(self, recipe: dict[str, Any], args: Any, kwargs: Any
                       ) -> list[tuple[Any, Any]]:
        """Argument sets whose weight tensors span ``span`` bytes (none when hot)."""
        if not self.span:
            return []
        params = [s for s in _tensor_specs([recipe["a"], list(recipe["k"].values())])
                  if self.trace.values[s["t"]].source == "param"]
        if not params:
            return []
        nbytes = sum(math.prod(s["shape"]) for s in params) * 4
        n = max(1, min(64, math.ceil(self.span / max(nbytes, 1))))
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
    (deploy: ``lower.stored.deploy_forward``, autocast off) around a trivial forward.
    Measured here: 8-15 us per wrapped Linear(4, 4), ~4 % of experiments/trap's forward."""
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


def _weight_bytes(trace: OpTrace) -> int:
    return sum(v.numel * v.itemsize for v in trace.values if v.source == "param")


def digest(trace: OpTrace, batch_size: int, machine: str) -> str:
    """What identifies one measurement: the recipes, the batch, the machine, torch."""
    h = hashlib.sha256()
    for op in trace.ops:
        h.update((_key(op.recipe, trace) if op.recipe else op.kind).encode())
    h.update(f"{batch_size}|{trace.batch_size}|{machine}|{torch.__version__}|{VERSION}"
             f"|{os.environ.get('ATEN_CPU_CAPABILITY', '')}".encode())
    return h.hexdigest()[:16]


def _variants(op: Op, floating: bool, precisions: Iterable[str]) -> list[str]:
    if not floating:
        return ["-"]
    out = [p for p in DTYPES if op.kind not in COMPUTE_KINDS or p in precisions]
    return out + [CL + p for p in out] if is_conv(op) else out


def measure(trace: OpTrace, batch_size: int, *, precisions: Iterable[str] = DTYPES,
            machine: str = "", progress: Callable[[int, int], None] | None = None) -> OpTimes:
    """Time every op of ``trace`` with a recipe, its casts and a module call, on this CPU
    at ``batch_size`` (the caller holds torch at the timing threads)."""
    t_start = time.perf_counter()
    precisions = set(precisions) | {"fp32"}
    scale = batch_size / trace.batch_size
    span = _span(_weight_bytes(trace))
    runner = _Runner(trace, scale, span)
    linear = _Runner(trace, 1.0, span)
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
    passes: dict[tuple[str, str], list[float] | None] = {k: [] for k in distinct}
    for p in range(PASSES):  # interleaved passes (see SAMPLES, PASSES)
        for n, (k, recipe) in enumerate(distinct.items()):
            got = passes[k]
            if got is not None:
                var = k[1]
                one = _try(runner, linear, recipe, DTYPES.get(var.removeprefix(CL)), scale,
                           channels_last=var.startswith(CL))
                passes[k] = None if one is None else [*got, one]
            if progress is not None:
                progress(p * len(distinct) + n + 1, PASSES * len(distinct))
    done = {k: float(np.median(v)) for k, v in passes.items() if v}
    for i, table, var, k in uses:
        if k in done:
            table.setdefault(i, {})[var] = done[k]
    out.distinct = len(done)
    out.casts = _cast_times(trace, scale, span)
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


def _cast_times(trace: OpTrace, scale: float, span: int) -> dict[str, float]:
    """One cast of every floating value's size, between fp32, bf16 and fp16."""
    sizes: set[tuple[int, bool]] = set()
    for v in trace.values:
        if v.dtype in DTYPES and v.numel > 0:
            weight = v.source == "param"
            n = v.numel if weight or not v.scales else int(round(v.numel * scale))
            sizes.add((max(1, n), weight and span > 0))
    out: dict[str, float] = {}
    for n, weight in sorted(sizes):
        for src, sdt in DTYPES.items():
            copies = max(1, min(64, math.ceil(span / (n * 4)))) if weight else 1
            xs = [torch.empty(n, dtype=sdt).uniform_(0.1, 1.0) for _ in range(copies)]
            for dst, ddt in DTYPES.items():
                if dst == src:
                    continue
                it = itertools.cycle(xs)
                out[cast_key(n, src, dst, weight)] = _time(
                    lambda it=it, ddt=ddt: next(it).to(ddt))
    return out


def cached_or_measured(trace: OpTrace, batch_size: int, cache_dir: Path, *, machine: str,
                       measure_now: bool, precisions: Iterable[str] = DTYPES,
                       progress: Callable[[int, int], None] | None = None
                       ) -> OpTimes | None:
    """The cached op times of this trace at ``batch_size`` on this machine; else, with
    ``measure_now``, measured and cached (atomically); else None."""
    d = digest(trace, batch_size, machine)
    path = Path(cache_dir) / f"ops-{d}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == VERSION and data.get("digest") == d:
                got = OpTimes.from_json(data)
                got.cached = True
                return got
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache file: measured again
    if not measure_now:
        return None
    got = measure(trace, batch_size, precisions=precisions, machine=machine,
                  progress=progress)
    got.digest = d
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(got.to_json()))
    return got


__all__ = ["OpTimes", "cached_or_measured", "cast_key", "digest", "is_conv", "measure"]
