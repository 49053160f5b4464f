"""Every kernel of a replayed plan priced on the target: the op-level half of the cost model.

``OpPricer._price(schedule)`` returns, for T plans at once, the seconds per ``PARTS`` of
every op, inserted cast and GEMM-format quantise pass the schedule runs: the roofline of
``cost.model``'s docs, or where the op was timed on this machine (``measure.op_times``) its
measured time. ``CostModel`` (``cost.model``) builds on it with the plan-level totals: which
plans can run, the all-fp32 reference, the breakdown per module, the weights held.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from autoprec.cost.op_times_record import OpTimes
from autoprec.cost.price_types import _CAST, _FP8, _GEMM, _OTHER, Kernel
from autoprec.cost.profiles import DeviceProfile
from autoprec.cost.unfolded import non_contiguous
from autoprec.formats.gemm import gemm_format
from autoprec.plan.compile import CODE, ModuleTree
from autoprec.plan.schedule import DTYPES, OTHER, WIDTH, Schedule
from autoprec.precisions import GEMM_FORMATS, PRECISIONS
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


class OpPricer:
    """Prices the ops of a recorded forward under replayed plans (``_price``).

    The cost model sets ``trace``, ``tree``, ``profile``, ``scale`` (deployment over
    recorded batch) and ``op_times`` before calling ``_static``, ``_tables`` and
    ``_measured_tables``.
    """

    trace: OpTrace
    tree: ModuleTree
    profile: DeviceProfile
    scale: float
    op_times: OpTimes | None
    #: a fused runtime (vLLM's qkv_proj, gate_up_proj): GEMM-format leaves that read the
    #: same activation in one format quantise it once (tune --fuse-groups auto)
    shared_quant_inputs: bool = False

    # -- static per-op arrays ------------------------------------------------------------------
    def _static(self) -> None:
        vals = self.trace.values
        s = self.scale
        self._numel = np.array([v.numel * (s if v.scales else 1.0) for v in vals])
        self._item = np.array([v.itemsize for v in vals], dtype=float)
        ran = np.zeros(len(self.tree.paths), dtype=bool)
        for c in self.trace.calls:
            if c.module >= 0:
                ran[c.module] = True
        self._ran = ran
        self._op_flops = []
        for op in self.trace.ops:
            scaled = any(vals[i].scales for i in op.inputs)
            self._op_flops.append(op.flops * (s if scaled else 1.0))
        self._fold_copy = {i: len(op.inputs) > 2 for i, op in enumerate(self.trace.ops)
                           if _folds_a_copy(op.name, op.recipe)}

    def _tables(self) -> None:
        prof = self.profile
        self._peak = np.array([prof.peak(p) for p in PRECISIONS])
        self._setup = np.array([prof.setup(p) for p in PRECISIONS])
        self._supported = np.array([prof.supports(p)[0] for p in PRECISIONS])
        self._bw = prof.bandwidth
        self._launch = prof.launch_overhead_s

    def _measured_tables(self) -> None:
        """Per op, its measured seconds indexed by compute precision code (GEMMs, SDPA) or
        by the dtype code of its first floating input (the rest); NaN: not measured."""
        self._timed: list[np.ndarray | None] = [None] * len(self.trace.ops)
        self._first_float: list[int | None] = [None] * len(self.trace.ops)
        self._fixed_s = 0.0  # views and the module calls: the same in every plan
        self._cast_tabs: dict[tuple[int, bool], np.ndarray] = {}
        self._wrapper_s: dict[str, float] = {}  # per form, one call through apply's wrapper
        t = self.op_times
        if t is None:
            return
        self._wrapper_s = dict(t.wrapper_s)
        vals = self.trace.values
        cl = self._convs_channels_last()
        for i, op in enumerate(self.trace.ops):
            if i in t.compute_cl and cl:
                self._timed[i] = _precision_table(t.compute_cl[i])
            elif i in t.compute:
                self._timed[i] = _precision_table(t.compute[i])
            elif i in t.other:
                tab = np.full(len(DTYPES), math.nan)
                got = t.other[i]
                if "-" in got:
                    tab[:] = got["-"]
                for d, sec in got.items():
                    if d in DTYPES:
                        tab[DTYPES.index(d)] = sec
                if op.kind == "view":
                    self._fixed_s += float(np.nanmax(tab)) if not np.isnan(tab).all() else 0.0
                    continue
                self._timed[i] = tab
                self._first_float[i] = next(
                    (k for k, v in enumerate(op.inputs) if vals[v].dtype in ("fp32", "bf16",
                                                                              "fp16")), None)
        self._fixed_s += len(self.trace.calls) * t.module_call_s

    def _convs_channels_last(self) -> bool:
        """Whether convolutions run channels-last (priced at ``OpTimes.compute_cl``): not
        in eager, where they run as the model lays them out."""
        return False

    def _op_seconds(self, i: int, sch: Schedule, comp: np.ndarray | None) -> np.ndarray | None:
        """(T,) measured seconds of op ``i`` under each plan row (NaN where not measured),
        or None when the op was not timed."""
        tab = self._timed[i]
        if tab is None:
            return None
        if comp is not None:
            return tab[comp]
        k = self._first_float[i]
        if k is None:
            return np.full(sch.plans, tab[DTYPES.index("fp32")])
        codes = sch.reads[i][k]
        return tab[np.where(codes < len(tab), codes, 0)]

    def _casts_weight(self, i: int, sch: Schedule) -> np.ndarray | None:
        """(T,) whether op ``i`` reads a parameter in another dtype than the one it is
        stored in: the training form's per-call cast of an fp32 master (the deploy form
        stores each weight in its precision). None: the op reads no parameter, or the
        deploy form."""
        if sch.form != "train":
            return None
        vals = self.trace.values
        out = None
        for k, v in enumerate(self.trace.ops[i].inputs):
            if vals[v].source == "param" and vals[v].dtype in DTYPES:
                cast = np.asarray(sch.reads[i][k]) != DTYPES.index(vals[v].dtype)
                out = cast if out is None else out | cast
        return None if out is None else np.broadcast_to(out, (sch.plans,))

    def _cast_seconds(self, value: int, src: np.ndarray, dst: np.ndarray, weight: bool
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

    def _bytes(self, ids: Sequence[int], codes: np.ndarray) -> np.ndarray:
        """Bytes of values ``ids`` carried in dtype ``codes`` (n, T)."""
        if not len(ids):
            return np.zeros(codes.shape[-1])
        idx = np.asarray(ids)
        w = WIDTH[codes].astype(float)
        w = np.where(codes == OTHER, self._item[idx][:, None], w)
        return (w * self._numel[idx][:, None]).sum(axis=0)

    def _price(self, sch: Schedule, collect: list[tuple[int, Kernel]] | None = None
               ) -> np.ndarray:
        """(T, 4) seconds per PARTS; ``collect`` receives row 0's kernels (module, kernel)."""
        t = sch.plans
        parts = np.zeros((t, 4))
        bw, launch = self._bw, self._launch
        tr = self.trace
        for i, op in enumerate(tr.ops):
            kern = np.broadcast_to(np.asarray(sch.kernel[i], dtype=bool), (t,))
            if op.kind == "view" or not kern.any():
                continue
            ins = list(op.inputs)
            reads = sch.reads[i]
            if op.kind == "embedding":  # the gathered rows, not the whole table
                nbytes = self._bytes(op.outputs, sch.writes[i]) * 2
            else:
                nbytes = self._bytes(ins, reads) + self._bytes(op.outputs, sch.writes[i])
            if i in self._fold_copy:  # the input's copy, and the bias added on its own
                nbytes = nbytes + 2 * self._bytes(ins[:1], reads[:1])
                if self._fold_copy[i]:
                    nbytes = nbytes + 2 * self._bytes(op.outputs, sch.writes[i])
            comp = sch.compute[i]
            if comp is not None:
                flops = self._op_flops[i]
                peak = self._peak[comp]
                with np.errstate(divide="ignore"):
                    ct = np.where(peak > 0, flops / np.where(peak > 0, peak, 1.0), math.inf)
                tm = np.maximum(ct, nbytes / bw) + launch + self._setup[comp]
                cat = _GEMM
            else:
                tm = nbytes / bw + launch
                cat = _CAST if op.kind == "cast" else _OTHER
            timed = (self._cast_seconds(op.inputs[0], sch.reads[i][0], sch.writes[i][0],
                                        False) if op.kind == "cast" and op.inputs
                     and self.op_times is not None else self._op_seconds(i, sch, comp))
            if timed is not None:
                tm = np.where(np.isnan(timed), tm, timed)
            parts[:, cat] += np.where(kern, tm, 0.0)
            if collect is not None and kern[0]:
                prec = PRECISIONS[int(comp[0])] if comp is not None else "fp32"
                collect.append((op.module, Kernel(
                    op.kind if comp is not None else ("cast" if op.kind == "cast" else op.kind),
                    float(nbytes[0]), float(self._op_flops[i]) if comp is not None else 0.0,
                    prec, 1.0, 1.0 if comp is not None else 0.0)))
        parts[:, _OTHER] += self._fixed_s + self._wrapper_s.get(sch.form, 0.0) * sch.wrapper_calls
        for c in sch.casts:
            n = self._numel[c.value]
            tm = n * (WIDTH[c.src] + WIDTH[c.dst]) / bw + launch
            timed = self._cast_seconds(c.value, c.src, c.dst, c.weight)
            if timed is not None:
                tm = np.where(np.isnan(timed), tm, timed)
            parts[:, _CAST] += np.where(c.on, tm, 0.0)
            if collect is not None and c.on[0]:
                collect.append((self._cast_module(sch, c.event), Kernel(
                    "weight_cast" if c.weight else "cast",
                    float(n * (WIDTH[c.src[0]] + WIDTH[c.dst[0]])))))
        done: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for f in sch.quant_inputs:
            n = self._numel[f.value]
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

    def _cast_module(self, sch: Schedule, event: int) -> int:
        what, idx = self.trace.events[event]
        if what == 0:
            return self.trace.ops[idx].module
        return self.trace.calls[idx].module


__all__ = ["OpPricer"]
