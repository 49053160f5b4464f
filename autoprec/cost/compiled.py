"""Compile mode: a plan's forward priced as ``torch.compile`` (inductor) runs it, not op by op.

``CompiledPricer`` is the forward pricer ``CostModel(..., mode="compile")`` holds in place
of the eager one (``op_pricing.EagerPricer``).

The recorded forward replayed under a plan (``autoprec.plan.schedule``: every op's dtypes,
every cast) is regrouped into the kernels inductor generates:

- *extern kernels* stay one call each at the precision they compute in, priced as in eager
  mode (``CostModel``): GEMMs (linear -> addmm / mm with the bias inside, bmm, conv) and
  SDPA;
- every other op that launches a kernel in eager mode — norms, softmax, activations,
  residual adds, the model's own casts, embedding gathers, factories — and every cast the
  plan inserts (autocast's input casts, weights included; fp32 islands' entry casts;
  16-bit outputs cast back to fp32) is *fused*: the ops between two extern calls, in
  program order, form one *segment*, and a segment runs as fused kernels that read each
  value produced outside them once (at the dtype it is stored in) and write once each value
  read outside them (by a later extern or segment, or returned by the model). Values that
  live only inside a segment (a bias add's output feeding GELU, a cast's source) are never
  written: a cast costs its 16-bit store and the read of whoever reads it, not a read and
  a write of its own.
- *CSE*: a value cast twice to the same dtype (q, k and v projections reading one
  LayerNorm output; a tied weight) is cast once: inductor's graph is CSE'd, autocast's
  per-call re-cast (``cache_enabled=False`` in eager) is gone.
- CPU (inductor's C++ backend): every fused node of a segment is *one* kernel (one launch):
  the C++ scheduler puts the weight casts of the next GEMM in the same kernel as the
  activation's epilogue (seen in the generated code: ``cpp_fused__to_copy_gelu_1`` casts
  the GELU output, the weight and the bias of the next Linear). CUDA (Triton): a segment
  runs one kernel per group of nodes connected by data (a weight cast, which reads only
  its weight, is its own kernel); that is the rule below for ``horizontal=False``.
- GEMM formats: per-tensor fp8 current scaling is priced as an amax pass (reading the
  16-bit input; fused into the producing kernel on CUDA, where it is an epilogue
  reduction) and a scale-and-cast pass (a second kernel on CUDA: it needs the finished
  amax), MXFP8 as one fused pass; weights are quantised once (cached), as in eager.
- Measured op times (a local CPU, ``measure.op_times``): the extern kernels take their time
  measured here, as in eager, a convolution its channels-last time (inductor's CPU layout),
  a Linear over a transposed 3-D input whose weight the plan casts the time of the ``bmm``
  inductor runs instead of the folded GEMM (``cost.unfolded``); the fused segments cost
  the larger of the calibrated roofline and the seconds their activations, norms,
  softmaxes and master-weight casts took timed one by one (``_fused_eager_seconds``: on a
  CPU thread those kernels are bound by their arithmetic, a weight cast by the cold read).

A training step (``tune --compile --form train``): the forward is priced as above (replayed
with autocast's weight-cast cache off, as a step runs it) and the step part
(``cost.step.StepPart``) adds the backward, the optimizer and the GradScaler as it does for
eager. The compiled backward is priced kernel by kernel as eager runs it: its GEMMs (dgrad,
wgrad) and fused attention's backward are extern calls in inductor's backward graph too,
priced the same; its pointwise kernels and casts are not fused here, so the backward's
memory-bound part is an upper bound of what inductor's fused backward runs.

Weights are read every call and their casts run every call (the default
``torch.compile``); freezing (``torch._inductor.config.freezing``) would constant-fold them,
which ``frozen=True`` prices (the casts cost nothing, a GEMM reads the 16-bit weight).

Uncertain (measured against inductor in ``benchmarks/compile_cost.py``; see README):
whether two reductions of different shapes share one Triton kernel (the rule fuses any
data-connected nodes of a segment, as the C++ backend does); Triton's launch overhead
under CUDA graphs (the profile's ``launch_overhead_us`` is eager's); the amax/cast fusion
of fp8 (no fp8 on this team's CPUs); inductor's pattern rewrites (e.g. a decomposed
attention matched back into SDPA) are not modelled: the recorded ops are what is priced.
Pointwise FLOPs are not priced (memory-bound), as in eager mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from autoprec.cost.op_pricing import OpTable, Roofline, casts_weight
from autoprec.cost.price_types import _FP8, _GEMM, _OTHER, Kernel
from autoprec.formats.gemm import GEMM_FORMAT_BY_NAME
from autoprec.plan.compile import CODE
from autoprec.plan.schedule import DTYPES, OTHER, WIDTH, Schedule
from autoprec.policy.schema import MODES  # deployment modes (policy ``target.mode``)

_PARAM = -2  # producer of parameters and model inputs (read, never written)
_EXTERN = -3  # producer/consumer id of an extern kernel (its bytes are priced with it)
_OUT = -4  # consumer id of the model's outputs (always written)
_SHIFT = 16  # dtype codes < 16: key = unit * _SHIFT + dtype
#: aten ops that produce a view in inductor although their schema returns a new tensor.
_VIEWS = frozenset({"_unsafe_view", "alias", "lift_fresh", "detach"})
#: aten ops whose fused kernel does the arithmetic aten's does (``_fused_eager_seconds``):
#: transcendental activations, norms, softmax.
_ARITHMETIC = frozenset({
    "gelu", "silu", "tanh", "sigmoid", "erf", "exp", "log", "rsqrt", "sqrt", "pow", "mish",
    "hardswish", "elu", "softplus", "_softmax", "_log_softmax", "softmax", "log_softmax",
    "native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm"})


def _is_extern(op) -> bool:  # noqa: ANN001
    """A GEMM/conv/SDPA: its own kernel call in inductor's program. SDPA reached below the
    function level (``nn.MultiheadAttention`` calls aten's
    ``_scaled_dot_product_flash_attention_for_cpu`` & co. directly) counts too."""
    return op.kind in ("gemm", "attention") or "scaled_dot_product" in op.name


@dataclass
class _Edge:
    """A value version read by a node: ``chain`` lists its possible producers, latest
    first, each with the rows where it is the one that produced the version (a cast that
    does not run in a row leaves the read to the version before it)."""

    reader: int  # node id of the reader; -1: the model's caller (outputs)
    active: np.ndarray | bool  # (T,) rows where the reader runs
    chain: list[tuple[int, np.ndarray | bool]]  # (node, rows) latest first
    base: int  # value id (views resolved to the viewed value)
    numel: float  # elements read (the viewed value's, at the deployment batch)
    item: float  # bytes per element for the OTHER dtype code
    dtype: np.ndarray  # (T,) dtype code the version carries


def convs_channels_last() -> bool:
    """Inductor's CPU backend runs every convolution of a graph channels-last when oneDNN
    is there (``torch._inductor.graph.GraphLowering.decide_layout_opt``): the op timings
    (a local CPU's) price each convolution at its channels-last time."""
    return bool(torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available())


class CompiledPricer:
    """The forward as ``torch.compile`` runs it: extern GEMM/SDPA calls + fused segments.

    ``horizontal``: one kernel per segment (inductor's C++ backend; default on the cpu
    profile) or one per data-connected group (Triton; default on GPU profiles).
    ``frozen``: weight casts constant-folded (``torch._inductor.config.freezing``).
    ``call_overhead_s``: seconds per forward outside the kernels (dynamo's guards and the
    compiled wrapper's Python; ``measure.call_overhead`` measures it as the intercept of
    compiled chains of 1 and 8 tiny kernel pairs); a profile calibrated in compile mode
    carries it, a datasheet one has 0. The same for every plan, so it moves speed-ups,
    not rankings. ``shared_quant_inputs`` is not modelled here (kept for the protocol).
    """

    def __init__(self, roofline: Roofline, table: OpTable, *, horizontal: bool,
                 frozen: bool = False, call_overhead_s: float = 0.0) -> None:
        self.roofline = roofline
        self.table = table
        self.horizontal = horizontal
        self.frozen = frozen
        self.call_overhead_s = max(0.0, float(call_overhead_s))
        self.shared_quant_inputs = False
        self.trace = roofline.trace
        #: the ops ``_fused_eager_seconds`` sums (found once, priced per schedule)
        self._arithmetic = [i for i, op in enumerate(self.trace.ops) if op.name in _ARITHMETIC]

    def _unfolded_seconds(self, i: int, sch: Schedule, comp: np.ndarray,
                          timed: np.ndarray | None) -> np.ndarray:
        """(T,) seconds of GEMM ``i``: the unfolded ``bmm``'s (``cost.unfolded``) in the
        rows that cast its weight per call (the training form reading it in another dtype
        than the parameter's; the deploy form stores each weight in its precision), the
        folded GEMM's (``timed``; NaN: not timed) in the others."""
        cast = casts_weight(self.trace, i, sch)
        if cast is None:
            cast = np.zeros(sch.plans, dtype=bool)
        alt = self.table.unfolded[i][comp]
        folded = np.full(sch.plans, math.nan) if timed is None else timed
        return np.where(cast & ~np.isnan(alt), alt, folded)

    # -- the fused program ---------------------------------------------------------------
    def _units(self, sch: Schedule) -> tuple[list[_Edge], np.ndarray, list[tuple[int, object]],
                                              list[int]]:
        """Walk the schedule: the edges, the node -> unit map, the nodes' activity and the
        fp8 quantisation nodes. Units are segments (horizontal) or data-connected groups."""
        tr, t = self.trace, sch.plans
        vals = tr.values
        node_seg: list[int] = []  # segment of each fused node (externs: _EXTERN)
        node_on: list[np.ndarray | bool] = []
        node_module: list[int] = []
        edges: list[_Edge] = []
        base = list(range(len(vals)))
        init = np.array([DTYPES.index(v.dtype) if v.dtype in DTYPES[:6] else OTHER
                         for v in vals], dtype=np.int8)
        cur: dict[int, tuple[list[tuple[int, np.ndarray | bool]], np.ndarray]] = {}
        casts_at: dict[int, list] = {}
        for c in sch.casts:
            casts_at.setdefault(c.event, []).append(c)
        quant_at: dict[int, list] = {}
        for f in sch.quant_inputs:
            quant_at.setdefault(f.op, []).append(f)
        cse: dict[tuple[int, int], list[tuple[int, np.ndarray, np.ndarray]]] = {}
        saved: dict[int, dict[int, tuple]] = {}
        quant: list[tuple[int, object]] = []  # (segment, QuantInput)
        seg = 0
        depth = 0
        root_outputs: list[int] = []

        def version(v: int) -> tuple[list[tuple[int, np.ndarray | bool]], np.ndarray]:
            got = cur.get(v)
            if got is None:
                got = cur[v] = ([], np.full(t, init[v], dtype=np.int8))
            return got

        def node(segment: int, on: np.ndarray | bool, module: int) -> int:
            node_seg.append(segment)
            node_on.append(on)
            node_module.append(module)
            return len(node_seg) - 1

        def read(reader: int, active: np.ndarray | bool, v: int, chain: list, dtype: np.ndarray,
                 numel: float | None = None) -> None:
            edges.append(_Edge(reader, active, chain, base[v],
                               self.roofline.numel[v] if numel is None else numel,
                               float(vals[v].itemsize), dtype))

        def cast(c, module: int) -> tuple[list, np.ndarray]:  # noqa: ANN001
            """A cast node reading the current version of c.value; returns the version it
            makes (with CSE against earlier casts of the same version to the same dtype)."""
            chain, dtype = version(c.value)
            vid = chain[0][0] if chain else -1  # the version: the node that made it
            on = np.asarray(c.on, dtype=bool)
            if c.weight and self.frozen:  # constant-folded: the GEMM reads the cast weight
                n = node(_PARAM, False, module)
                return [(n, on)] + chain, np.where(on, c.dst, dtype).astype(np.int8)
            earlier = cse.setdefault((vid, c.value), [])
            dup_chain: list[tuple[int, np.ndarray | bool]] = []
            dup = np.zeros(t, dtype=bool)
            for n_e, on_e, dst_e in earlier:
                hit = on & on_e & (dst_e == c.dst) & ~dup
                if hit.any():
                    dup_chain.append((n_e, hit))
                    dup |= hit
            mine = on & ~dup
            n = node(seg, mine, module)
            read(n, mine, c.value, chain, dtype)
            earlier.append((n, mine, np.asarray(c.dst)))
            new_chain = [(n, mine), *dup_chain, *chain]
            return new_chain, np.where(on, c.dst, dtype).astype(np.int8)

        for ev, (what, idx) in enumerate(tr.events):
            if what == 1:
                call = tr.calls[idx]
                if depth == 0:
                    root_outputs.extend(call.outputs)
                depth += 1
                mine: dict[int, tuple] = {}
                for c in casts_at.get(ev, ()):
                    mine.setdefault(c.value, version(c.value))
                    cur[c.value] = cast(c, call.module)
                saved[idx] = mine
                continue
            if what == 2:
                depth -= 1
                call = tr.calls[idx]
                for v, old in saved.pop(idx, {}).items():
                    if v not in call.outputs:
                        cur[v] = old
                for c in casts_at.get(ev, ()):
                    cur[c.value] = cast(c, call.module)
                continue
            op = tr.ops[idx]
            reads = sch.reads[idx]
            if op.kind == "view" or op.name in _VIEWS:
                if op.inputs:
                    src = op.inputs[0]
                    for o in op.outputs:
                        cur[o] = version(src)
                        base[o] = base[src]
                continue
            temp: dict[int, tuple] = {}
            for c in casts_at.get(ev, ()):
                temp[c.value] = cast(c, op.module)
            kern = sch.kernel[idx]
            extern = _is_extern(op)
            if extern:
                for f in quant_at.get(idx, ()):
                    quant.append((seg, f))
                    node(seg, np.asarray(f.on, dtype=bool), op.module)
            unit = _EXTERN if extern else seg
            n = node(unit, kern, op.module)
            for k, v in enumerate(op.inputs):
                chain, _ = temp.get(v) or version(v)
                numel = None
                if op.kind == "embedding" and vals[v].source == "param":
                    numel = float(sum(self.roofline.numel[o] for o in op.outputs))  # gathered
                read(n, kern, v, chain, reads[k], numel)
            writes = sch.writes[idx]
            for j, o in enumerate(op.outputs):
                if op.kind == "cast" and op.inputs and not isinstance(kern, bool):
                    chain = [(n, kern), *version(op.inputs[0])[0]]  # a no-op cast aliases
                else:
                    chain = [(n, True)]
                cur[o] = (chain, writes[j].astype(np.int8))
            if extern:
                seg += 1
        for v in dict.fromkeys(root_outputs):
            if v < len(vals) and vals[v].dtype in DTYPES[:6]:
                chain, dtype = version(v)
                read(-1, True, v, chain, dtype)
        unit_of = np.array(node_seg, dtype=np.int64)
        if not self.horizontal:
            unit_of = self._groups(unit_of, edges)
        self._node_module = node_module
        return edges, unit_of, list(zip(node_on, range(len(node_on)), strict=True)), \
            [s for s, _ in quant]

    @staticmethod
    def _groups(unit_of: np.ndarray, edges: list[_Edge]) -> np.ndarray:
        """Triton: split each segment into groups of nodes connected by data."""
        parent = list(range(len(unit_of)))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        # an edge joins its reader with the producers in its chain that share its segment;
        # the reader is the node created right after the edge's producers (unit = segment)
        for e in edges:
            if e.reader < 0 or unit_of[e.reader] < 0:
                continue
            for nd, _ in e.chain:
                if unit_of[nd] == unit_of[e.reader]:
                    parent[find(nd)] = find(e.reader)
        out = unit_of.copy()
        fused = unit_of >= 0
        roots = np.array([find(i) for i in range(len(unit_of))])
        out[fused] = roots[fused]
        return out

    def price(self, sch: Schedule, collect: list[tuple[int, Kernel]] | None = None
              ) -> np.ndarray:
        """(T, 4) seconds per PARTS; ``collect`` receives row 0's kernels."""
        t = sch.plans
        parts = np.zeros((t, 4))
        tr = self.trace
        r = self.roofline
        bw, launch = r.bw, r.launch
        # extern kernels: as in eager mode
        for i, op in enumerate(tr.ops):
            if not _is_extern(op):
                continue
            nbytes = r.bytes(list(op.inputs), sch.reads[i]) + r.bytes(
                op.outputs, sch.writes[i])
            comp = sch.compute[i]
            timed = self.table.op_seconds(i, sch, comp)  # measured here (a local CPU)
            if comp is not None and i in self.table.unfolded:
                timed = self._unfolded_seconds(i, sch, comp, timed)
            if comp is None:  # an aten-level SDPA: no FLOPs recorded, memory-bound
                tm = nbytes / bw + launch
                parts[:, _GEMM] += tm if timed is None else np.where(np.isnan(timed), tm, timed)
                if collect is not None:
                    collect.append((op.module, Kernel("attention", float(nbytes[0]))))
                continue
            peak = r.peak[comp]
            with np.errstate(divide="ignore"):
                ct = np.where(peak > 0, r.op_flops[i] / np.where(peak > 0, peak, 1.0),
                              math.inf)
            tm = np.maximum(ct, nbytes / bw) + launch + r.setup[comp]
            parts[:, _GEMM] += tm if timed is None else np.where(np.isnan(timed), tm, timed)
            if collect is not None:
                collect.append((op.module, Kernel(op.kind, float(nbytes[0]),
                                                  float(r.op_flops[i]),
                                                  _prec_name(int(comp[0])), 1.0, 1.0)))
        edges, unit_of, nodes, quant_segs = self._units(sch)
        # fused bytes: per value, the distinct (unit, dtype) reads and writes of each row
        by_value: dict[tuple[int, float], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        for e in edges:
            prod = np.full(t, _PARAM, dtype=np.int64)
            seen = np.zeros(t, dtype=bool)
            for nd, rows in e.chain:
                sel = np.asarray(rows, dtype=bool) & ~seen
                prod = np.where(sel, unit_of[nd], prod)
                seen |= np.asarray(rows, dtype=bool)
            cons = _OUT if e.reader < 0 else int(unit_of[e.reader])
            ext = np.broadcast_to(np.asarray(e.active, dtype=bool), (t,)) & (prod != cons)
            dt = e.dtype.astype(np.int64)
            rd = np.where(ext & (cons >= 0), cons * _SHIFT + dt, -1)
            wr = np.where(ext & (prod >= 0), prod * _SHIFT + dt, -1)
            by_value.setdefault((e.base, e.numel, e.item), []).append((rd, wr, prod))
        width = WIDTH.copy()
        fused = np.zeros(t)
        per_unit: dict[int, float] = {}
        for (_, numel, item), rows in by_value.items():
            w = width.copy()
            w[OTHER] = item
            for col in (0, 1):
                keys = np.sort(np.stack([r[col] for r in rows]), axis=0)  # (k, T)
                first = np.ones_like(keys, dtype=bool)
                first[1:] = keys[1:] != keys[:-1]
                valid = first & (keys >= 0)
                nb = np.where(valid, w[np.where(keys >= 0, keys % _SHIFT, 0)] * numel, 0.0)
                fused += nb.sum(axis=0)
                if collect is not None:
                    for k in np.flatnonzero(valid[:, 0]):
                        u = int(keys[k, 0] // _SHIFT)
                        per_unit[u] = per_unit.get(u, 0.0) + float(nb[k, 0])
        # launches: units with a node that runs
        live: dict[int, np.ndarray] = {}
        for on, nd in nodes:
            u = int(unit_of[nd])
            if u < 0:
                continue
            a = np.broadcast_to(np.asarray(on, dtype=bool), (t,))
            live[u] = live[u] | a if u in live else a.copy()
        launches = np.zeros(t)
        for a in live.values():
            launches += a
        # fp8 & co: amax read + scale-and-cast pass (read, write the format's bytes)
        qbytes = np.zeros(t)
        for f in sch.quant_inputs:
            n = r.numel[f.value]
            src = WIDTH[f.src]
            for name, fmt in GEMM_FORMAT_BY_NAME.items():
                on = f.on & (f.fmt == CODE[name])
                if on.any():
                    qbytes += np.where(on, fmt.quant_bytes(n, src), 0.0)
                    if not self.horizontal:  # the cast waits for the amax
                        launches += np.where(on, fmt.quant_reads - 1, 0)
        fused_s = fused / bw
        eager = self._fused_eager_seconds(sch)
        if eager is not None:  # timed here: the fused kernels compute what the ops did
            fused_s = np.maximum(fused_s, eager)
        parts[:, _OTHER] += fused_s + launches * launch + self.call_overhead_s
        parts[:, _FP8] += qbytes / bw
        if collect is not None:
            for u, a in live.items():
                if a[0]:
                    m = self._unit_module(u, unit_of)
                    collect.append((m, Kernel("fused", per_unit.get(u, 0.0))))
            if qbytes[0] > 0:
                collect.append((-1, Kernel("fp8_cast", float(qbytes[0]), launches=0.0)))
        return parts

    def _fused_eager_seconds(self, sch: Schedule) -> np.ndarray | None:
        """(T,) seconds the fused activations, norms and softmaxes (``_ARITHMETIC``) took
        timed one by one here (``op_times``; None without them): what inductor's fused
        kernels cost at least on a CPU.

        On one CPU thread those ops are bound by their arithmetic, not by memory: inductor's
        C++ kernel runs the same vectorised GELU, LayerNorm or softmax as aten's, and fusion
        saves only the round trips through memory (which the L2 absorbs at these sizes).
        Other ops are left to the roofline: inductor runs them otherwise than eager (a
        max-pool without its indices) or they are memory-bound (adds, activation casts). An
        op not timed adds 0. (Measured: docs/cost_history.md.)

        The training form's per-call casts of the fp32 master weights add their timed
        seconds too: each reads a weight the forward last touched one forward earlier
        (``measure.ops._cast_times``), which the calibrated bandwidth (cache-hot copies)
        does not see."""
        if self.table.op_times is None:
            return None
        t = sch.plans
        total = np.zeros(t)
        for i in self._arithmetic:
            kern = np.broadcast_to(np.asarray(sch.kernel[i], dtype=bool), (t,))
            if not kern.any():
                continue
            sec = self.table.op_seconds(i, sch, None)
            if sec is not None:
                total += np.where(kern & ~np.isnan(sec), sec, 0.0)
        for c in sch.casts if not self.frozen else ():
            if c.weight:  # a master weight's per-call cast: reads it cold (measure.ops)
                sec = self.table.cast_seconds(c.value, c.src, c.dst, True)
                if sec is not None:
                    total += np.where(c.on & ~np.isnan(sec), sec, 0.0)
        return total

    def _unit_module(self, unit: int, unit_of: np.ndarray) -> int:
        hits = np.flatnonzero(unit_of == unit)
        return self._node_module[int(hits[-1])] if len(hits) else -1


def _prec_name(code: int) -> str:
    from autoprec.formats.precisions import PRECISIONS

    return PRECISIONS[code]


__all__ = ["CompiledPricer", "MODES", "convs_channels_last"]
