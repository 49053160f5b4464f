"""Every kernel of a replayed plan priced on the target: the op-level half of the cost model.

Three parts, composed by ``CostModel`` (``cost.model``):

- ``Roofline``: the trace's per-op arrays (elements, FLOPs at the priced batch) and the
  profile's tables (peak per precision, GEMM set-up, bandwidth, launch);
- ``OpTable``: this machine's measured seconds of the model's own ops, casts and wrapper
  calls (``OpTimes``; empty without them), looked up per plan row;
- ``EagerPricer``: the forward as eager PyTorch runs it, op by op: ``price(schedule)``
  returns, for T plans at once, the seconds per ``PARTS`` of every op, inserted cast and
  GEMM-format quantise pass the schedule runs: the roofline of ``cost.model``'s docs, or
  where the op was timed here its measured time. ``cost.compiled.CompiledPricer`` is the
  other forward pricer (``ForwardPricer``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from autoprec.cost.op_times_record import OpTimes
from autoprec.cost.price_types import _CAST, _FP8, _GEMM, _OTHER, Kernel
from autoprec.cost.profiles import DeviceProfile
from autoprec.cost.unfolded import non_contiguous
from autoprec.formats.gemm import gemm_format
from autoprec.formats.precisions import GEMM_FORMATS, PRECISIONS
from autoprec.plan.compile import CODE, ModuleTree
from autoprec.plan.schedule import DTYPES, OTHER, WIDTH, Schedule
from autoprec.trace.ops import OpTrace

#: The GEMM formats by precision code: each knows the quantisation passes of its activation
#: input and what they cost (``GemmFormat.quant_seconds`` / ``quant_kernels``).
_FORMAT_OF_CODE = {CODE[f]: gemm_format(f) for f in GEMM_FORMATS}


def _precision_table(got: Mapping[str, float]) -> np.ndarray:
    """Measured seconds per precision code (NaN: not timed); a CPU's tf32 is its fp32."""
    tab = np.full(len(PRECISIONS), math.nan)
    for p, sec in got.items():
        tab[PRECISIONS.index(p)] = sec
    if "fp32" in got and "tf32" in PRECISIONS:
        tab[PRECISIONS.index("tf32")] = got["fp32"]  # a CPU has no tf32
    return tab


def _folds_a_copy(name: str, recipe: dict | None) -> bool:
    """A ``linear`` over a non-contiguous input of 3 or more dimensions: torch's ``linear``
    runs it as a ``matmul`` that copies the input into rows first (``should_fold``) and adds
    the bias as its own kernel (``nn.MultiheadAttention``'s in-projection over its
    transposed ``batch_first`` input). Its op timing includes both; the roofline adds them."""
    if name != "linear" or recipe is None or not recipe["a"]:
        return False
    x = recipe["a"][0]
    return (isinstance(x, dict) and "shape" in x and len(x["shape"]) >= 3
            and non_contiguous(list(x["shape"]), list(x["stride"])))


@dataclass(frozen=True)
class Roofline:
    """The trace's per-op arrays and the profile's tables a roofline prices with.

    ``numel``: elements of every value at the priced batch (``scale``: deployment over
    recorded batch, applied to values derived from the model input); ``item``: bytes per
    element of the dtype it was recorded in; ``op_flops``: each op's FLOPs at the priced
    batch; ``ran``: modules the recorded forward called; ``fold_copy``: linears that copy a
    non-contiguous input first (value: whether a bias adds its own kernel);
    ``peak``/``setup``/``supported``: per precision code; ``bw``: bytes per second;
    ``launch``: seconds per kernel launch.
    """

    trace: OpTrace
    profile: DeviceProfile
    scale: float
    numel: np.ndarray
    item: np.ndarray
    op_flops: list[float]
    ran: np.ndarray
    fold_copy: dict[int, bool]
    peak: np.ndarray
    setup: np.ndarray
    supported: np.ndarray
    bw: float
    launch: float

    @classmethod
    def of(cls, trace: OpTrace, tree: ModuleTree, profile: DeviceProfile,
           scale: float) -> Roofline:
        vals = trace.values
        numel = np.array([v.numel * (scale if v.scales else 1.0) for v in vals])
        item = np.array([v.itemsize for v in vals], dtype=float)
        ran = np.zeros(len(tree.paths), dtype=bool)
        for c in trace.calls:
            if c.module >= 0:
                ran[c.module] = True
        op_flops = []
        for op in trace.ops:
            scaled = any(vals[i].scales for i in op.inputs)
            op_flops.append(op.flops * (scale if scaled else 1.0))
        fold_copy = {i: len(op.inputs) > 2 for i, op in enumerate(trace.ops)
                     if _folds_a_copy(op.name, op.recipe)}
        return cls(trace, profile, scale, numel, item, op_flops, ran, fold_copy,
                   **_profile_tables(profile))

    def for_profile(self, profile: DeviceProfile) -> Roofline:
        """The same trace's arrays with another profile's tables."""
        return replace(self, profile=profile, **_profile_tables(profile))

    def bytes(self, ids: Sequence[int], codes: np.ndarray) -> np.ndarray:
        """Bytes of values ``ids`` carried in dtype ``codes`` (n, T)."""
        if not len(ids):
            return np.zeros(codes.shape[-1])
        idx = np.asarray(ids)
        w = WIDTH[codes].astype(float)
        w = np.where(codes == OTHER, self.item[idx][:, None], w)
        return (w * self.numel[idx][:, None]).sum(axis=0)


def _profile_tables(prof: DeviceProfile) -> dict[str, object]:
    return {"peak": np.array([prof.peak(p) for p in PRECISIONS]),
            "setup": np.array([prof.setup(p) for p in PRECISIONS]),
            "supported": np.array([prof.supports(p)[0] for p in PRECISIONS]),
            "bw": prof.bandwidth, "launch": prof.launch_overhead_s}


class OpTable:
    """This machine's measured seconds of a trace's ops (``OpTimes``), per plan row.

    ``timed[i]``: op ``i``'s seconds indexed by compute precision code (GEMMs, SDPA) or by
    the dtype code of its first floating input (the rest); NaN: not measured; None: the op
    was not timed. ``fixed_s``: views and the module calls, the same in every plan;
    ``wrapper_s``: per form, one call through apply's wrapper; ``unfolded``: per GEMM
    inductor does not fold when its weight is cast, the ``bmm``'s seconds
    (``cost.unfolded``). ``channels_last``: convolutions priced at their channels-last
    time (inductor's CPU layout). Without ``op_times`` the table is empty.
    """

    def __init__(self, trace: OpTrace, op_times: OpTimes | None, scale: float, *,
                 channels_last: bool = False) -> None:
        self.trace = trace
        self.op_times = op_times
        self.scale = scale
        self.timed: list[np.ndarray | None] = [None] * len(trace.ops)
        self._first_float: list[int | None] = [None] * len(trace.ops)
        self.fixed_s = 0.0
        self._cast_tabs: dict[tuple[int, bool], np.ndarray] = {}
        self.wrapper_s: dict[str, float] = {}
        self.unfolded: dict[int, np.ndarray] = {}
        t = op_times
        if t is None:
            return
        self.wrapper_s = dict(t.wrapper_s)
        self.unfolded = {i: _precision_table(got) for i, got in t.compute_unfolded.items()}
        vals = trace.values
        for i, op in enumerate(trace.ops):
            if i in t.compute_cl and channels_last:
                self.timed[i] = _precision_table(t.compute_cl[i])
            elif i in t.compute:
                self.timed[i] = _precision_table(t.compute[i])
            elif i in t.other:
                tab = np.full(len(DTYPES), math.nan)
                got = t.other[i]
                if "-" in got:
                    tab[:] = got["-"]
                for d, sec in got.items():
                    if d in DTYPES:
                        tab[DTYPES.index(d)] = sec
                if op.kind == "view":
                    self.fixed_s += float(np.nanmax(tab)) if not np.isnan(tab).all() else 0.0
                    continue
                self.timed[i] = tab
                self._first_float[i] = next(
                    (k for k, v in enumerate(op.inputs) if vals[v].dtype in ("fp32", "bf16",
                                                                              "fp16")), None)
        self.fixed_s += len(trace.calls) * t.module_call_s

    def op_seconds(self, i: int, sch: Schedule, comp: np.ndarray | None) -> np.ndarray | None:
        """(T,) measured seconds of op ``i`` under each plan row (NaN where not measured),
        or None when the op was not timed."""
        tab = self.timed[i]
        if tab is None:
            return None
        if comp is not None:
            return tab[comp]
        k = self._first_float[i]
        if k is None:
            return np.full(sch.plans, tab[DTYPES.index("fp32")])
        codes = sch.reads[i][k]
        return tab[np.where(codes < len(tab), codes, 0)]

    def cast_seconds(self, value: int, src: np.ndarray, dst: np.ndarray, weight: bool
                     ) -> np.ndarray | None:
        """(T,) measured seconds of casting ``value`` src -> dst (NaN where not timed)."""
        t = self.op_times
        if t is None:
            return None
        v = self.trace.values[value]
        n = v.numel if not v.scales else int(round(v.numel * self.scale))
        key = (max(1, n), weight)
        tab = self._cast_tabs.get(key)
        if tab is None:
            tab = np.full((len(DTYPES), len(DTYPES)), math.nan)
            for a in ("fp32", "bf16", "fp16"):
                for b in ("fp32", "bf16", "fp16"):
                    if a != b:
                        got = t.cast_s(key[0], a, b, weight)
                        if got is not None:
                            tab[DTYPES.index(a), DTYPES.index(b)] = got
            self._cast_tabs[key] = tab
        return tab[np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)]


def casts_weight(trace: OpTrace, i: int, sch: Schedule) -> np.ndarray | None:
    """(T,) whether op ``i`` reads a parameter in another dtype than the one it is stored
    in: the training form's per-call cast of an fp32 master (the deploy form stores each
    weight in its precision). None: the op reads no parameter, or the deploy form."""
    if sch.form != "train":
        return None
    vals = trace.values
    out = None
    for k, v in enumerate(trace.ops[i].inputs):
        if vals[v].source == "param" and vals[v].dtype in DTYPES:
            cast = np.asarray(sch.reads[i][k]) != DTYPES.index(vals[v].dtype)
            out = cast if out is None else out | cast
    return None if out is None else np.broadcast_to(out, (sch.plans,))


class ForwardPricer(Protocol):
    """Prices the recorded forward's kernels under replayed plans.

    ``price(sch, collect)`` returns (T, 4) seconds per ``PARTS`` of the T plans of ``sch``;
    ``collect``, when given, receives row 0's kernels as (module index, ``Kernel``). It
    must not change ``sch``. ``roofline`` and ``table`` are the arrays it prices with
    (the training step prices its backward with the same).
    """

    roofline: Roofline
    table: OpTable
    shared_quant_inputs: bool

    def price(self, sch: Schedule, collect: list[tuple[int, Kernel]] | None = None
              ) -> np.ndarray: ...


class EagerPricer:
    """The forward as eager PyTorch runs it: one kernel per recorded op, back to back.

    ``shared_quant_inputs``: a fused runtime (vLLM's qkv_proj, gate_up_proj): GEMM-format
    leaves that read the same activation in one format quantise it once (tune
    --fuse-groups auto).
    """

    def __init__(self, roofline: Roofline, table: OpTable) -> None:
        self.roofline = roofline
        self.table = table
        self.shared_quant_inputs = False

    def price(self, sch: Schedule, collect: list[tuple[int, Kernel]] | None = None
              ) -> np.ndarray:
        """(T, 4) seconds per PARTS; ``collect`` receives row 0's kernels (module, kernel)."""
        t = sch.plans
        parts = np.zeros((t, 4))
        r, tab = self.roofline, self.table
        bw, launch = r.bw, r.launch
        tr = r.trace
        for i, op in enumerate(tr.ops):
            kern = np.broadcast_to(np.asarray(sch.kernel[i], dtype=bool), (t,))
            if op.kind == "view" or not kern.any():
                continue
            ins = list(op.inputs)
            reads = sch.reads[i]
            if op.kind == "embedding":  # the gathered rows, not the whole table
                nbytes = r.bytes(op.outputs, sch.writes[i]) * 2
            else:
                nbytes = r.bytes(ins, reads) + r.bytes(op.outputs, sch.writes[i])
            if i in r.fold_copy:  # the input's copy, and the bias added on its own
                nbytes = nbytes + 2 * r.bytes(ins[:1], reads[:1])
                if r.fold_copy[i]:
                    nbytes = nbytes + 2 * r.bytes(op.outputs, sch.writes[i])
            comp = sch.compute[i]
            if comp is not None:
                flops = r.op_flops[i]
                peak = r.peak[comp]
                with np.errstate(divide="ignore"):
                    ct = np.where(peak > 0, flops / np.where(peak > 0, peak, 1.0), math.inf)
                tm = np.maximum(ct, nbytes / bw) + launch + r.setup[comp]
                cat = _GEMM
            else:
                tm = nbytes / bw + launch
                cat = _CAST if op.kind == "cast" else _OTHER
            timed = (tab.cast_seconds(op.inputs[0], sch.reads[i][0], sch.writes[i][0],
                                        False) if op.kind == "cast" and op.inputs
                     and tab.op_times is not None else tab.op_seconds(i, sch, comp))
            if timed is not None:
                tm = np.where(np.isnan(timed), tm, timed)
            parts[:, cat] += np.where(kern, tm, 0.0)
            if collect is not None and kern[0]:
                prec = PRECISIONS[int(comp[0])] if comp is not None else "fp32"
                collect.append((op.module, Kernel(
                    op.kind if comp is not None else ("cast" if op.kind == "cast" else op.kind),
                    float(nbytes[0]), float(r.op_flops[i]) if comp is not None else 0.0,
                    prec, 1.0, 1.0 if comp is not None else 0.0)))
        parts[:, _OTHER] += tab.fixed_s + tab.wrapper_s.get(sch.form, 0.0) * sch.wrapper_calls
        for c in sch.casts:
            n = r.numel[c.value]
            tm = n * (WIDTH[c.src] + WIDTH[c.dst]) / bw + launch
            timed = tab.cast_seconds(c.value, c.src, c.dst, c.weight)
            if timed is not None:
                tm = np.where(np.isnan(timed), tm, timed)
            parts[:, _CAST] += np.where(c.on, tm, 0.0)
            if collect is not None and c.on[0]:
                collect.append((_cast_module(tr, c.event), Kernel(
                    "weight_cast" if c.weight else "cast",
                    float(n * (WIDTH[c.src[0]] + WIDTH[c.dst[0]])))))
        done: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for f in sch.quant_inputs:
            n = r.numel[f.value]
            for code, fmt in _FORMAT_OF_CODE.items():
                on = f.on & (f.fmt == code)
                if self.shared_quant_inputs:  # quantised already, in this dtype: shared
                    prev = done.get((f.value, code))
                    if prev is not None:
                        seen, src = prev
                        dup = on & seen & (src == f.src)
                        done[(f.value, code)] = (seen | on, np.where(seen, src, f.src))
                        on = on & ~dup
                    else:
                        done[(f.value, code)] = (on.copy(), f.src.copy())
                if not on.any():
                    continue
                tm = fmt.quant_seconds(n, WIDTH[f.src], bw, launch)
                parts[:, _FP8] += np.where(on, tm, 0.0)
                if collect is not None and on[0]:
                    m = tr.ops[f.op].module
                    collect.extend((m, Kernel(kind, nb))
                                   for kind, nb in fmt.quant_kernels(n, float(WIDTH[f.src[0]])))
        return parts


def _cast_module(trace: OpTrace, event: int) -> int:
    what, idx = trace.events[event]
    if what == 0:
        return trace.ops[idx].module
    return trace.calls[idx].module


__all__ = ["EagerPricer", "ForwardPricer", "OpTable", "Roofline", "casts_weight"]
