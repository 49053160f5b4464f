"""Roofline cost model: estimated time of a model under a per-layer precision assignment.

Every layer is a list of kernels; a kernel takes ``max(FLOPs / (peak x eff), bytes /
bandwidth) + launches x overhead`` (+ a fixed set-up per GEMM call where the profile has
one, e.g. oneDNN on CPU). Kernels run one after another (eager PyTorch, one stream).

What is priced ("price what really runs", DESIGN.md):

- GEMM at precision p reads weights and input and writes output at p's storage width
  (fp32/tf32: 4 bytes; bf16/fp16: 2; fp8: 1-byte weights and input). By default 16-bit
  activations flow from layer to layer (OUT_DTYPE), as under one autocast region.
  KNOWN GAP: apply wraps each lowered layer of a per-layer policy and casts its 16-bit
  output back to fp32 when it returns to an fp32 caller, so the next layer casts again.
  ``exit_cast=True`` prices that (WRAPPED_OUT_DTYPE + an exit-cast kernel); on
  memory-bound layers it costs enough that tf32 often matches 16-bit per-layer policies
  (experiments/results). Removing those casts between same-precision neighbours in apply
  is the fix; until then the default prices the cast-free schedule.
- bf16/fp16 run under ``torch.autocast(cache_enabled=False)`` (``apply.lower``), which
  casts the fp32 master weights on every call: a weight-cast kernel (read 4, write 2
  bytes per element). ``autocast_weight_cast="once"`` prices pre-cast weights instead.
- fp8 with current scaling: per input, an amax pass (read), a scale kernel (launch only)
  and a cast to fp8 (read 16/32 bits, write 1 byte); weights are cast once, not per call
  (``fp8_weight_cast="per_call"`` prices an amax + cast of the weights on every call).
- A cast where a GEMM's input arrives in another dtype than it computes in (read + write
  the activation). The arrival dtype is the output dtype of the producing GEMM
  (``LayerNode.inputs_from`` and ``LayerGraph.edges``; fp8 GEMMs emit bf16; the model
  input is fp32; layers not in the assignment take the default). Several producers
  mean a merge (residual add, concat) into one tensor, whose dtype follows PyTorch's type
  promotion: fp32 if any producer emits fp32, bf16 with fp16 gives fp32, else the common
  16-bit dtype. Without any data-flow information (e.g. the hooks tracer), each GEMM's
  producer is the previous GEMM in execution order.
- Non-GEMM nodes (norms, activations, softmax, elementwise, and containers whose own
  code has FLOPs) are memory-bound: inputs and outputs at the width of the activation
  flowing through them, found the same way (``inputs_from``, else the nearest earlier
  GEMM): 4 bytes under fp32/tf32, 2 bytes after a bf16/fp16/fp8 GEMM; parameters at
  4 bytes. Embeddings read only the rows they gather; dropout is free (identity at
  inference).
- Known gap: a residual stream that starts at the fp32 model input stays fp32 after
  ``x + bf16_out``, but edges between GEMMs do not show the model input, so such a merge
  of 16-bit producers is priced as 16-bit.

Activation terms (FLOPs, in/out elements) scale by ``batch_size / graph.batch_size``;
weight elements, calls and launches do not ("price at the deployment shape").

Hot path: everything that does not depend on the assignment is precomputed into numpy
tables (GEMM node x precision; consumer x arrival dtype x precision; non-GEMM node x
arrival dtype), so an estimate is a few gathers, one OR-reduction and three sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoprec.cost.profiles import DeviceProfile
from autoprec.errors import InputError
from autoprec.precisions import PRECISIONS, check_precision
from autoprec.trace.graph import LayerGraph, LayerNode

_NP = len(PRECISIONS)
_CODE = {p: i for i, p in enumerate(PRECISIONS)}
_FP32 = _CODE["fp32"]

#: dtype an activation leaves a GEMM in when 16-bit activations flow from layer to layer
#: (``exit_cast=False``: one autocast region around several layers; fp8 GEMMs write bf16).
OUT_DTYPE = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}
#: With ``exit_cast=True``: apply wraps every lowered layer of a per-layer
#: policy (what tune writes: default fp32, one rule per GEMM layer) and casts its 16-bit
#: output back to fp32 when it returns to its fp32 caller, so a bf16 and a fp16 neighbour
#: never meet in one op. The GEMM writes 16 bits, an exit cast writes fp32, and the next
#: layer receives fp32 and casts again; fp8 layers fed fp32 write fp32.
WRAPPED_OUT_DTYPE = {p: "fp32" for p in PRECISIONS}
WRAPPED_GEMM_OUT_DTYPE = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16",
                          "fp8": "fp32"}
#: dtype a GEMM reads its activation input in.
IN_DTYPE = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: Storage width of weights read by the GEMM itself.
WEIGHT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

_ELEMENTWISE_KINDS = ("norm", "softmax", "activation", "elementwise", "other", "container")


@dataclass(frozen=True)
class Kernel:
    """One launched kernel (or ``launches`` identical ones), independent of the device."""

    what: str  # gemm, weight_cast, input_cast, amax, fp8_scale, fp8_cast, elementwise
    bytes: float  # bytes moved in total
    flops: float = 0.0
    precision: str = "fp32"  # whose peak prices the FLOPs (and the GEMM set-up)
    launches: float = 0.0
    gemm_calls: float = 0.0  # GEMM calls that pay the profile's per-call set-up

    def time(self, profile: DeviceProfile) -> float:
        """Seconds on ``profile`` (inf if the FLOPs need a precision it lacks)."""
        compute = 0.0
        if self.flops > 0:
            peak = profile.peak(self.precision)
            if peak <= 0:
                return math.inf
            compute = self.flops / peak
        memory = self.bytes / profile.bandwidth
        return (max(compute, memory) + self.launches * profile.launch_overhead_s
                + self.gemm_calls * profile.setup(self.precision))

    def bound(self, profile: DeviceProfile) -> str:
        """What dominates this kernel: "compute", "memory" or "launch"."""
        peak = profile.peak(self.precision)
        parts = {
            "compute": self.flops / peak if peak > 0 else math.inf,
            "memory": self.bytes / profile.bandwidth,
            "launch": self.launches * profile.launch_overhead_s
            + self.gemm_calls * profile.setup(self.precision),
        }
        return max(parts, key=lambda k: parts[k])


@dataclass(frozen=True)
class LayerCost:
    """One row of ``CostModel.breakdown``: a priced node under an assignment."""

    layer: str
    kind: str
    precision: str  # GEMM: assigned precision; other nodes: dtype of their activation
    time_s: float
    cast_s: float  # part of time_s spent on input casts / fp8 input passes
    bound: str  # of the main kernel: compute, memory or launch


def _gemm_kernels(n: LayerNode, p: str, scale: float, autocast_weight_cast: str,
                  fp8_weight_cast: str, exit_cast: bool) -> list[Kernel]:
    flops = n.flops * scale
    i_el, o_el, w_el, calls = n.in_elems * scale, n.out_elems * scale, n.weight_elems, n.calls
    in_b = DTYPE_BYTES[IN_DTYPE[p]]
    written = WRAPPED_GEMM_OUT_DTYPE[p] if exit_cast else OUT_DTYPE[p]
    out_b = DTYPE_BYTES[written]
    ks = [Kernel("gemm", WEIGHT_BYTES[p] * w_el + in_b * i_el + out_b * o_el, flops, p,
                 launches=calls, gemm_calls=calls)]
    if exit_cast and written != WRAPPED_OUT_DTYPE[p] and o_el > 0:  # apply's cast to fp32
        ks.append(Kernel("exit_cast", (out_b + 4) * o_el, launches=calls))
    if w_el > 0 and p in ("bf16", "fp16") and autocast_weight_cast == "per_call":
        ks.append(Kernel("weight_cast", (4 + 2) * w_el, launches=calls))
    if w_el > 0 and p == "fp8" and fp8_weight_cast == "per_call":
        ks.append(Kernel("amax", 4 * w_el, launches=calls))
        ks.append(Kernel("weight_cast", (4 + 1) * w_el, launches=calls))
    return ks


def _input_kernels(elems: float, arrival: str, p: str, calls: int) -> list[Kernel]:
    """Kernels to bring ``elems`` activation elements arriving in ``arrival`` to ``p``."""
    if elems <= 0:
        return []
    a_b = DTYPE_BYTES[arrival]
    if p == "fp8":
        # Current scaling (Transformer Engine's Float8CurrentScaling; torchao's Float8Linear):
        # an amax reduction over the input, a tiny kernel turning amax into the scale
        # (448 / amax), then the scaled cast to e4m3. Three launches per input per call.
        return [Kernel("amax", a_b * elems, launches=calls),
                Kernel("fp8_scale", 0.0, launches=calls),
                Kernel("fp8_cast", (a_b + 1) * elems, launches=calls)]
    want = IN_DTYPE[p]
    if want == arrival:
        return []
    return [Kernel("input_cast", (a_b + DTYPE_BYTES[want]) * elems, launches=calls)]


def _other_kernels(n: LayerNode, dtype: str, scale: float) -> list[Kernel]:
    """A memory-bound non-GEMM node whose activations are stored in ``dtype``."""
    if n.kind == "dropout":
        return []
    if n.kind == "embedding":  # gathers out_elems rows of the fp32 table, writes fp32
        return [Kernel("elementwise", 8 * n.out_elems * scale, launches=n.calls)]
    b = DTYPE_BYTES[dtype]
    nbytes = b * (n.in_elems + n.out_elems) * scale + 4 * n.weight_elems
    return [Kernel("elementwise", nbytes, n.flops * scale, "fp32", launches=n.calls)]


def _time(kernels: Sequence[Kernel], profile: DeviceProfile) -> float:
    return float(sum(k.time(profile) for k in kernels))


#: Activation dtypes between layers, and the code of each precision's output dtype.
ARRIVALS = ("fp32", "bf16", "fp16")
# bit mask of producer dtypes -> promoted dtype (PyTorch: bf16 + fp16 -> fp32)
_PROMOTE = np.array([0, 0, 1, 0, 2, 0, 0, 0], dtype=np.intp)


class CostModel:
    """Estimated time of ``graph`` on ``profile`` at deployment ``batch_size``.

    ``estimate(assignment)`` maps GEMM-node paths to precisions (missing: ``default``)
    and returns seconds per forward pass; a precision the device lacks costs ``inf``
    (``infeasible`` says why). See the module docstring for what is priced.
    """

    def __init__(
        self,
        graph: LayerGraph,
        profile: DeviceProfile,
        batch_size: int | None = None,
        default: str = "fp32",
        *,
        autocast_weight_cast: str = "per_call",
        fp8_weight_cast: str = "once",
        exit_cast: bool = False,
    ) -> None:
        check_precision(default, "default precision")
        for name, v in (("autocast_weight_cast", autocast_weight_cast),
                        ("fp8_weight_cast", fp8_weight_cast)):
            if v not in ("per_call", "once"):
                raise InputError(f"{name} must be 'per_call' or 'once', but got {v!r}")
        if graph.batch_size < 1:
            raise InputError(f"graph.batch_size >= 1 must hold, but got {graph.batch_size}")
        if batch_size is None:
            batch_size = graph.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"--batch-size must be a positive integer, but got {batch_size!r}")
        self.graph = graph
        self.profile = profile
        self.batch_size = batch_size
        self.default = default
        self.scale = batch_size / graph.batch_size
        self.gemm = graph.gemm_nodes
        self.paths: list[str] = [n.path for n in self.gemm]
        self._index = {p: i for i, p in enumerate(self.paths)}
        n = len(self.paths)
        self._source = n  # pseudo-producer: the model input (fp32)
        self._default_codes = np.full(n, _CODE[default], dtype=np.intp)
        wc = (autocast_weight_cast, fp8_weight_cast, exit_cast)
        out = WRAPPED_OUT_DTYPE if exit_cast else OUT_DTYPE
        self._out_code = np.array([ARRIVALS.index(out[p]) for p in PRECISIONS] + [0],
                                  dtype=np.intp)
        # GEMM nodes: own kernels per precision; input kernels per arrival x precision
        self._node_k = [[_gemm_kernels(nd, p, self.scale, *wc) for p in PRECISIONS]
                        for nd in self.gemm]
        self._in_k = [[[_input_kernels(nd.in_elems * self.scale, a, p, nd.calls)
                        for p in PRECISIONS] for a in ARRIVALS] for nd in self.gemm]
        # non-GEMM nodes: kernels per arrival dtype
        self._others = self._priced_others()
        self._other_k = [[_other_kernels(nd, a, self.scale) for a in ARRIVALS]
                         for nd in self._others]
        # consumers 0..n-1 are GEMM nodes, n.. the non-GEMM nodes; each has >= 1 producer
        gemm_prods, self.flow = self._gemm_producers()
        other_prods = self._other_producers()
        self._producers = gemm_prods + other_prods
        self._build_tables()

    # ------------------------------------------------------------------ structure

    def _gemm_producers(self) -> tuple[list[list[int]], str]:
        from_edges: dict[str, list[str]] = {}
        for prod, cons in self.graph.edges:
            from_edges.setdefault(cons, []).append(prod)
        has_flow = bool(self.graph.edges) or any(nd.inputs_from for nd in self.gemm)
        out: list[list[int]] = []
        for c, nd in enumerate(self.gemm):
            if not has_flow:
                out.append([c - 1] if c > 0 else [self._source])
                continue
            prods: list[int] = []
            for name in [*nd.inputs_from, *from_edges.get(nd.path, [])]:
                i = self._index.get(name, self._source)
                if i != c and i not in prods:
                    prods.append(i)
            out.append(prods or [self._source])
        return out, "graph" if has_flow else "execution order"

    def _priced_others(self) -> list[LayerNode]:
        out = []
        for nd in self.graph:
            if nd.calls <= 0 or nd.is_gemm:
                continue
            if not (nd.is_leaf or nd.flops > 0):
                continue  # a container's own code costs nothing unless it computes
            if nd.kind in (*_ELEMENTWISE_KINDS, "embedding", "dropout"):
                out.append(nd)
        return out

    def _other_producers(self) -> list[list[int]]:
        priced = {nd.path for nd in self._others}
        out: list[list[int]] = []
        last_gemm = self._source
        for nd in self.graph:
            if nd.calls > 0 and nd.is_gemm:
                last_gemm = self._index.get(nd.path, last_gemm)
            if nd.path not in priced:
                continue
            if nd.inputs_from:
                gem = [self._index[x] for x in nd.inputs_from if x in self._index]
                out.append(list(dict.fromkeys(gem)) or [self._source])
            else:
                out.append([last_gemm])
        return out

    def _build_tables(self) -> None:
        prof = self.profile
        n, m = len(self.paths), len(self._others)
        self._node_tab = np.array([[_time(ks, prof) for ks in row] for row in self._node_k],
                                  dtype=float).reshape(n, _NP)
        for j, p in enumerate(PRECISIONS):
            if not prof.supports(p)[0]:
                self._node_tab[:, j] = math.inf
        self._in_tab = np.array([[[_time(ks, prof) for ks in row] for row in c]
                                 for c in self._in_k], dtype=float).reshape(n, 3, _NP)
        self._other_tab = np.array([[_time(ks, prof) for ks in row] for row in self._other_k],
                                   dtype=float).reshape(m, 3)
        # producer lists flattened in consumer order, for one OR-reduction per consumer
        prods = [p for ps in self._producers for p in ps]
        self._e_prod = np.array(prods, dtype=np.intp)
        lens = [len(ps) for ps in self._producers]
        self._e_start = np.cumsum([0, *lens[:-1]]).astype(np.intp)
        self._ar = np.arange(n)
        self._o_ar = np.arange(m)
        self._fp32_time = float(self.estimate_codes(np.full(n, _FP32)))

    # ------------------------------------------------------------------ evaluation

    def _arrivals(self, codes: np.ndarray) -> np.ndarray:
        """Arrival dtype code (index into ARRIVALS) of every consumer, (..., n + m)."""
        ext = np.concatenate([codes, np.full(codes.shape[:-1] + (1,), len(PRECISIONS),
                                             np.intp)], -1)  # the source: code 5 -> fp32
        bits = np.left_shift(1, self._out_code[ext[..., self._e_prod]])
        if len(self._e_start) == 0:
            return np.zeros(codes.shape[:-1] + (0,), dtype=np.intp)
        return _PROMOTE[np.bitwise_or.reduceat(bits, self._e_start, axis=-1)]

    def _parts(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(own GEMM time, GEMM input-cast time, non-GEMM time) per node."""
        n = len(self.paths)
        arr = self._arrivals(codes)
        own = self._node_tab[self._ar, codes]
        cast = self._in_tab[self._ar, arr[..., :n], codes]
        other = self._other_tab[self._o_ar, arr[..., n:]]
        return own, cast, other

    # ------------------------------------------------------------------ public API

    def encode(self, assignment: Mapping[str, str]) -> np.ndarray:
        """Precision codes (index into PRECISIONS) per GEMM node, in ``self.paths`` order.

        A path of the graph that is no priced GEMM node (a norm, a layer that did not run)
        changes nothing: autocast leaves such modules as they are. A path the graph does
        not have is an InputError.
        """
        codes = self._default_codes.copy()
        for path, prec in assignment.items():
            i = self._index.get(path)
            if i is None:
                if path in self.graph:
                    check_precision(prec, f"layer {path!r}")
                    continue
                raise InputError(f"assignment names {path!r}, which is not a layer of "
                                 f"{self.graph.model_name or 'the model'}")
            c = _CODE.get(prec)
            codes[i] = c if c is not None else _CODE[check_precision(prec, f"layer {path!r}")]
        return codes

    def layer_index(self, path: str) -> int | None:
        """Position of GEMM node ``path`` in the code vectors (None: not a priced GEMM)."""
        return self._index.get(path)

    def estimate_codes(self, codes: np.ndarray) -> np.ndarray | float:
        """Seconds for one code vector (n,) or a batch (T, n) of them (vectorised)."""
        codes = np.asarray(codes, dtype=np.intp)
        own, cast, other = self._parts(codes)
        t = own.sum(-1) + cast.sum(-1) + other.sum(-1)
        return float(t) if np.ndim(t) == 0 else t

    def estimate(self, assignment: Mapping[str, str]) -> float:
        """Seconds per forward pass at ``self.batch_size`` (inf: infeasible)."""
        return float(self.estimate_codes(self.encode(assignment)))

    @property
    def fp32_time(self) -> float:
        """Seconds with every layer in fp32 (the reference of ``speedup``)."""
        return self._fp32_time

    def speedup(self, assignment: Mapping[str, str]) -> float:
        """All-fp32 time over the assignment's time (0.0 when infeasible)."""
        t = self.estimate(assignment)
        return 0.0 if math.isinf(t) else self._fp32_time / t

    def precision_of(self, assignment: Mapping[str, str]) -> dict[str, str]:
        """Every GEMM node's precision (assignment + default)."""
        codes = self.encode(assignment)
        return {p: PRECISIONS[c] for p, c in zip(self.paths, codes, strict=True)}

    def infeasible(self, assignment: Mapping[str, str]) -> list[str]:
        """Why the assignment cannot run: "path: reason" per layer (empty: feasible).

        Reasons are the device lacking a precision and the layer's own ``disallowed``
        reasons from the trace (e.g. fp8 on dims not a multiple of 16).
        """
        out = []
        for path, prec in self.precision_of(assignment).items():
            ok, why = self.profile.supports(prec)
            if not ok:
                out.append(f"{path}: {why}")
                continue
            nd = self.graph[path]
            if nd.allowed and prec not in nd.allowed:
                out.append(f"{path}: {nd.disallowed.get(prec, f'{prec}: not allowed here')}")
        return out

    def layer_times(self, assignment: Mapping[str, str]) -> dict[str, float]:
        """Seconds per priced node (casts counted at the consumer), execution order."""
        return {r.layer: r.time_s for r in self.breakdown(assignment)}

    def breakdown(self, assignment: Mapping[str, str]) -> list[LayerCost]:
        """Per-node costs under the assignment, in execution order."""
        codes = self.encode(assignment)
        own, cast, other = self._parts(codes)
        arr = self._arrivals(codes)
        n = len(self.paths)
        rows: dict[str, LayerCost] = {}
        for i, nd in enumerate(self.gemm):
            main = self._node_k[i][codes[i]][0]
            rows[nd.path] = LayerCost(nd.path, nd.kind, PRECISIONS[codes[i]],
                                      float(own[i] + cast[i]), float(cast[i]),
                                      main.bound(self.profile))
        for j, nd in enumerate(self._others):
            ks = self._other_k[j][arr[n + j]]
            rows[nd.path] = LayerCost(nd.path, nd.kind, ARRIVALS[arr[n + j]], float(other[j]),
                                      0.0, ks[0].bound(self.profile) if ks else "launch")
        return [rows[nd.path] for nd in self.graph if nd.path in rows]

    def kernels(self, assignment: Mapping[str, str]) -> list[tuple[str, Kernel]]:
        """Every kernel the assignment launches, as (node path, kernel); for calibration."""
        codes = self.encode(assignment)
        arr = self._arrivals(codes)
        n = len(self.paths)
        out: list[tuple[str, Kernel]] = []
        for i, nd in enumerate(self.gemm):
            out.extend((nd.path, k) for k in self._in_k[i][arr[i]][codes[i]])
            out.extend((nd.path, k) for k in self._node_k[i][codes[i]])
        for j, nd in enumerate(self._others):
            out.extend((nd.path, k) for k in self._other_k[j][arr[n + j]])
        return out

    def with_profile(self, profile: DeviceProfile) -> CostModel:
        """The same graph and options priced on another (e.g. calibrated) profile."""
        new = object.__new__(CostModel)
        new.__dict__.update(self.__dict__)
        new.profile = profile
        new._build_tables()
        return new


__all__ = ["ARRIVALS", "CostModel", "IN_DTYPE", "Kernel", "LayerCost", "OUT_DTYPE"]
