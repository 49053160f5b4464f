"""Whole-forward roofline cost of an execution plan: every op the applied model runs.

The graph's op trace (``autoprec.trace.ops``: one recorded forward) is replayed under the
plan (``autoprec.plan.schedule``: the dtype of every tensor, every cast), and every kernel
of the replay is priced on the target profile:

    time = max(FLOPs / (peak(precision) x eff), bytes / bandwidth) + launch (+ GEMM set-up)

- GEMMs and SDPA at the precision they compute in (fp8 for an fp8 leaf, tf32 in a tf32
  region), reading their operands in the dtype they are read in and writing their output;
  SDPA is one fused kernel (q, k, v, mask in; output out), as on a CUDA target;
- every other op (norms, softmax, activations, residual adds, copies, the model's own
  explicit casts where they change the dtype) as memory-bound: the bytes of its inputs and
  outputs at the dtypes they carry; views cost nothing; an embedding reads the rows it
  gathers, not its table;
- every inserted cast (read + write, one launch): autocast's input casts — weights too,
  once per forward where the plan has one 16-bit dtype (autocast's cast cache), on every
  call where it has two — fp32 islands' input casts, 16-bit outputs cast back to fp32 when they return to a fp32 caller;
- fp8 current scaling per GEMM input: an amax pass (read), a scale kernel (launch only),
  the cast to e4m3 (read, write 1 byte); the GEMM reads 1-byte operands and writes the
  region's 16-bit dtype. Weights are quantised once per weight version (apply caches the
  e4m3 weight), not per forward.

Assumptions: eager PyTorch, one kernel per recorded op, one stream (kernels back to back),
no fusion. Activation terms scale by ``batch_size / graph.batch_size`` (values derived from
the model input); parameter bytes do not ("price at the deployment shape").

Measured op times (``op_times``, ``cost.op_times``: a local CPU target): where the model's
own op was timed here in the dtype a plan runs it in, that time replaces the roofline
term of the op (dispatch included, so no launch overhead is added); views cost their
dispatch; inserted casts their timed cast; every plan pays the recorded module calls'
host cost, and each call through one of apply's wrappers (``Schedule.wrapper_calls``) the
wrapper's. Ops without a timing keep the roofline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoprec.cost.op_times import OpTimes
from autoprec.cost.profiles import DeviceProfile
from autoprec.errors import InputError
from autoprec.formats.gemm import gemm_format
from autoprec.plan.compile import CODE, ModuleTree, RuleSet
from autoprec.plan.schedule import DTYPES, OTHER, WIDTH, Schedule, replay
from autoprec.policy.schema import Policy
from autoprec.precisions import BYTES, FORMS, GEMM_FORMATS, PRECISIONS, check_precision
from autoprec.targets import device_type
from autoprec.trace.graph import LayerGraph

#: Breakdown categories of a forward's time ("gemm_format_scaling": the quantise passes of
#: every GEMM format, fp8 / mxfp8 / nvfp4).
PARTS = ("gemm", "cast", "gemm_format_scaling", "other")
_GEMM, _CAST, _FP8, _OTHER = range(4)
#: Bytes per element a module's tensors are stored in under the deploy form, by region
#: code (fp32, tf32, bf16, fp16; the GEMM-format codes never are a region), and a GEMM
#: format's bytes per element (scales included) by precision code (0: not a format).
_STORE_WIDTH = np.array([BYTES["fp32"], BYTES["tf32"], BYTES["bf16"], BYTES["fp16"],
                         *[4] * len(GEMM_FORMATS)], dtype=float)
_FORMAT_WIDTH = np.array([BYTES[p] if p in GEMM_FORMATS else 0.0 for p in PRECISIONS])
#: The GEMM formats by precision code: each knows the quantisation passes of its activation
#: input and what they cost (``GemmFormat.quant_seconds`` / ``quant_kernels``).
_FORMAT_OF_CODE = {CODE[f]: gemm_format(f) for f in GEMM_FORMATS}


@dataclass(frozen=True)
class Kernel:
    """One launched kernel, independent of the device."""

    what: str  # gemm, attention, cast, weight_cast, amax, fp8_scale, fp8_cast, pointwise, ...
    bytes: float
    flops: float = 0.0
    precision: str = "fp32"  # whose peak prices the FLOPs (and the GEMM set-up)
    launches: float = 1.0
    gemm_calls: float = 0.0

    def time(self, profile: DeviceProfile) -> float:
        """Seconds on ``profile`` (inf if the FLOPs need a precision it lacks)."""
        compute = 0.0
        if self.flops > 0:
            peak = profile.peak(self.precision)
            if peak <= 0:
                return math.inf
            compute = self.flops / peak
        return (max(compute, self.bytes / profile.bandwidth)
                + self.launches * profile.launch_overhead_s
                + self.gemm_calls * profile.setup(self.precision))

    def bound(self, profile: DeviceProfile) -> str:
        """What dominates: "compute", "memory" or "launch"."""
        peak = profile.peak(self.precision)
        parts = {"compute": self.flops / peak if peak > 0 else math.inf,
                 "memory": self.bytes / profile.bandwidth,
                 "launch": self.launches * profile.launch_overhead_s
                 + self.gemm_calls * profile.setup(self.precision)}
        return max(parts, key=lambda k: parts[k])


@dataclass
class Breakdown:
    """Where one plan's forward time goes (seconds), and how many casts it runs."""

    total_s: float
    parts: dict[str, float]  # PARTS -> seconds
    casts: int  # activation casts per forward (inserted + the model's own, where real)
    weight_casts: int  # autocast's per-call weight casts
    kernels: int  # kernel launches
    by_module: dict[str, float] = field(default_factory=dict)  # module path -> seconds
    gemm_precision: dict[str, str] = field(default_factory=dict)  # module -> its GEMMs' precision
    invalid: str | None = None  # why the plan cannot run

    def to_dict(self) -> dict[str, object]:
        return {"total_us": round(self.total_s * 1e6, 3),
                **{f"{k}_us": round(v * 1e6, 3) for k, v in self.parts.items()},
                "casts": self.casts, "weight_casts": self.weight_casts,
                "kernels": self.kernels}


@dataclass
class Priced:
    """T plans priced at once (rows)."""

    time: np.ndarray  # (T,) seconds; inf when infeasible or invalid
    parts: np.ndarray  # (T, 4) seconds per PARTS
    schedule: Schedule
    reasons: dict[int, str]  # row -> why infeasible / invalid


def _precision_table(got: Mapping[str, float]) -> np.ndarray:
    """Measured seconds per precision code (NaN: not timed); a CPU's tf32 is its fp32."""
    tab = np.full(len(PRECISIONS), math.nan)
    for p, sec in got.items():
        tab[PRECISIONS.index(p)] = sec
    if "fp32" in got and "tf32" in PRECISIONS:
        tab[PRECISIONS.index("tf32")] = got["fp32"]  # a CPU has no tf32
    return tab


def device_type_of(profile: DeviceProfile) -> str:
    """Whose autocast lists apply: "cpu" for the cpu profile, "cuda" for the GPUs."""
    return device_type(profile.name)


class CostModel:
    """Estimated time of plans on ``profile`` at deployment ``batch_size``.

    ``estimate(policy)`` is the seconds of one forward under the policy's plan (inf when the
    device lacks a precision it uses, or the plan cannot run); ``speedup`` is over the
    all-fp32 plan. ``price(rules, codes)`` prices many plans at once for the search.
    """

    def __init__(self, graph: LayerGraph, profile: DeviceProfile,
                 batch_size: int | None = None, *, device_type: str | None = None,
                 form: str = "train", op_times: OpTimes | None = None) -> None:
        if graph.ops is None:
            raise InputError("the layer graph has no op trace; build it with autoprec.trace_model()")
        if graph.batch_size < 1:
            raise InputError(f"graph.batch_size >= 1 must hold, but got {graph.batch_size}")
        if batch_size is None:
            batch_size = graph.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"--batch-size must be a positive integer, but got {batch_size!r}")
        if form not in FORMS:
            raise InputError(f"form must be one of {', '.join(FORMS)}, but got {form!r}")
        self.form = form  # the form code rows are priced in (a Policy carries its own)
        self.graph = graph
        self.trace = graph.ops
        self.profile = profile
        self.batch_size = batch_size
        self.scale = batch_size / graph.batch_size
        self.device_type = device_type or device_type_of(profile)
        self.tree = ModuleTree.from_graph(graph)
        self._params = self._param_table()
        self.max_weight_bytes: float | None = None  # a plan holding more cannot deploy
        self._rulesets: dict[tuple[str, ...], RuleSet] = {}
        if op_times is not None and op_times.batch_size != batch_size:
            raise ValueError(f"op times measured at batch {op_times.batch_size}, priced at "
                             f"{batch_size}")
        self.op_times = op_times
        self._static()
        self._tables()
        self._measured_tables()
        self._fp32 = self._fp32_time()

    def _fp32_time(self) -> float:
        """The reference every speed-up divides: all fp32 with no autocast, the fp32 row
        tune and eval time (the training form's; whatever form this model prices in)."""
        return float(self.price(self.rules(()), np.array([[CODE["fp32"]]]), "train").time[0])

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
        for i, op in enumerate(self.trace.ops):
            if i in t.compute_cl and self._convs_channels_last():
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

    def with_profile(self, profile: DeviceProfile) -> CostModel:
        """The same trace priced on another (e.g. calibrated) profile."""
        new = object.__new__(CostModel)
        new.__dict__.update(self.__dict__)
        new.profile = profile
        new._tables()
        new._fp32 = new._fp32_time()
        return new

    # -- plans ---------------------------------------------------------------------------------
    def rules(self, paths: Sequence[str]) -> RuleSet:
        """The RuleSet for these rule paths (cached)."""
        key = tuple(paths)
        rs = self._rulesets.get(key)
        if rs is None:
            try:
                rs = self._rulesets[key] = RuleSet(self.tree, key)
            except KeyError as err:
                raise InputError(f"{self.graph.model_name or 'the model'} has no module "
                                 f"{err.args[0]!r}") from None
        return rs

    def _form(self, policy: Policy | Mapping[str, str]) -> str:
        return policy.form if isinstance(policy, Policy) else self.form

    def _row(self, policy: Policy | Mapping[str, str], default: str) -> tuple[RuleSet, np.ndarray]:
        if isinstance(policy, Policy):
            layers, default = dict(policy.layers), policy.default
        else:
            layers = dict(policy)
        check_precision(default, "default")
        for p, prec in layers.items():
            check_precision(prec, f"layer {p!r}")
        rs = self.rules(list(layers))
        return rs, rs.codes_of(default, layers)[None, :]

    def price(self, rules: RuleSet, codes: np.ndarray, form: str | None = None) -> Priced:
        """Price T plans: ``codes`` (T, K) code rows of ``rules`` (see plan.compile), in
        ``form`` (default: the model's ``form``)."""
        region, prec, wrapped = rules.encode(codes)
        sch = replay(self.trace, region, prec, wrapped, self.device_type,
                     form or self.form)
        parts = self._price(sch)
        time = parts.sum(axis=1)
        reasons = dict(sch.reasons)
        # a precision the device lacks, used by a module that runs
        used = np.where(self._ran[None, :], prec, CODE["fp32"])
        lacks = ~self._supported[used]
        bad = lacks.any(axis=1)
        for row in np.flatnonzero(bad):
            j = int(np.flatnonzero(lacks[row])[0])
            p = PRECISIONS[int(used[row, j])]
            reasons.setdefault(int(row), f"{self.tree.paths[j] or '<root>'}: "
                                         f"{self.profile.supports(p)[1]}")
        if self.max_weight_bytes is not None:
            held = self._weight_bytes(region, prec, form or self.form)
            over = held > self.max_weight_bytes
            for row in np.flatnonzero(over & ~bad):
                reasons.setdefault(int(row), f"weights {held[row] / 1e6:.1f} MB > the weight "
                                             f"budget {self.max_weight_bytes / 1e6:g} MB")
            bad = bad | over
        time = np.where(bad | sch.invalid, math.inf, time)
        return Priced(time, parts, sch, reasons)

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
        for f in sch.quant_inputs:
            n = self._numel[f.value]
            for code, fmt in _FORMAT_OF_CODE.items():
                on = f.on & (f.fmt == code)
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

    # -- one plan --------------------------------------------------------------------------------
    def schedule(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> Schedule:
        """The replay of the recorded forward under one plan (row 0)."""
        rs, row = self._row(policy, default)
        region, prec, wrapped = rs.encode(row)
        return replay(self.trace, region, prec, wrapped, self.device_type, self._form(policy))

    def estimate(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> float:
        """Seconds per forward under ``policy`` (a Policy, or rules with ``default``)."""
        rs, row = self._row(policy, default)
        return float(self.price(rs, row, self._form(policy)).time[0])

    @property
    def fp32_time(self) -> float:
        """Seconds of the all-fp32 plan (the reference of ``speedup``)."""
        return self._fp32

    def speedup(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> float:
        """All-fp32 time over the plan's (0.0 when it cannot run on the target; 1.0 for a
        forward with nothing to price, e.g. ``nn.Identity``: no precision changes it)."""
        t = self.estimate(policy, default)
        if not math.isfinite(t):
            return 0.0
        return self._fp32 / t if t > 0 else 1.0

    def cannot_run(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> list[str]:
        """Why the plan cannot run on the target (empty: it can)."""
        rs, row = self._row(policy, default)
        got = self.price(rs, row, self._form(policy)).reasons.get(0)
        return [got] if got else []

    def breakdown(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> Breakdown:
        """Where the forward's time goes under the plan, per part and per module."""
        sch = self.schedule(policy, default)
        kernels: list[tuple[int, Kernel]] = []
        parts = self._price(sch, kernels)[0]
        by_module: dict[str, float] = {}
        for m, k in kernels:
            path = self.tree.paths[m] if m >= 0 else "<outside>"
            by_module[path] = by_module.get(path, 0.0) + k.time(self.profile)
        gemm_prec: dict[str, set[str]] = {}
        for i, op in enumerate(self.trace.ops):
            comp = sch.compute[i]
            if comp is not None and op.module >= 0:
                gemm_prec.setdefault(self.tree.paths[op.module], set()).add(
                    PRECISIONS[int(comp[0])])
        total = float(parts.sum())
        invalid = sch.reasons.get(0)
        return Breakdown(total if invalid is None else math.inf,
                         {k: float(v) for k, v in zip(PARTS, parts, strict=True)},
                         sch.cast_count(0), sch.cast_count(0, weights=True),
                         sum(int(k.launches) for _, k in kernels), by_module,
                         {p: ",".join(sorted(v, key=PRECISIONS.index))
                          for p, v in gemm_prec.items()}, invalid)

    def weight_bytes(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> int:
        """Bytes of the weights (parameters and floating buffers) the applied plan holds on
        the device (``_weight_bytes``)."""
        rs, row = self._row(policy, default)
        region, prec, _ = rs.encode(row)
        return int(round(float(self._weight_bytes(region, prec, self._form(policy))[0])))

    def _weight_bytes(self, region: np.ndarray, prec: np.ndarray, form: str) -> np.ndarray:
        """(T,) bytes of the weights T plans hold: in the deploy form each tensor at its
        owner's storage width (a GEMM-format leaf's weight at its format's, scales
        included; a tensor tied between owners of two dtypes once per dtype); in the train
        form the fp32 masters plus each GEMM-format leaf's cached quantised weight
        (autocast's per-call casts are transient)."""
        fixed, owners, numel, matrix = self._params
        deploy = form == "deploy"
        store = _STORE_WIDTH[region]  # (T, M) storage bytes per element of each module
        fmt = _FORMAT_WIDTH[prec]  # (T, M) a GEMM format's bytes per element, else 0
        total = np.full(region.shape[0], fixed)
        for own, n, mat in zip(owners, numel, matrix, strict=True):
            seen: list[np.ndarray] = []
            for m in own:
                q = fmt[:, m] if mat else np.zeros(region.shape[0])
                if deploy:
                    w = np.where(q > 0, q, store[:, m])
                    new = np.ones_like(w, dtype=bool)
                    for s in seen:  # a tied tensor held once per distinct width
                        new &= w != s
                    total += n * np.where(new, w, 0.0)
                    seen.append(w)
                else:
                    if not seen:
                        total += n * 4.0
                        seen.append(q)
                    total += n * q  # the quantised copy beside the master
        return total

    def _param_table(self) -> tuple[float, list[list[int]], list[float], list[bool]]:
        """The floating parameters and buffers of the trace, for ``_weight_bytes``: bytes
        of the others (fixed), and per floating tensor its owners, elements, and whether
        it is a matrix (a GEMM format quantises those, not a bias)."""
        index = {p: i for i, p in enumerate(self.trace.modules)}
        fixed, owners, numel, matrix = 0.0, [], [], []
        for v in self.trace.values:
            if v.source != "param":
                continue
            if v.dtype not in ("fp32", "bf16", "fp16"):
                fixed += v.numel * v.itemsize
                continue
            owners.append([index.get(p, 0) for p in (v.owners or (v.param.rpartition(".")[0],))])
            numel.append(float(v.numel))
            matrix.append(v.ndim >= 2)
        return fixed, owners, numel, matrix

    def kernels(self, policy: Policy | Mapping[str, str], default: str = "fp32"
                ) -> list[tuple[str, Kernel]]:
        """Every kernel the plan launches, as (module path, kernel); for calibration."""
        sch = self.schedule(policy, default)
        out: list[tuple[int, Kernel]] = []
        self._price(sch, out)
        return [(self.tree.paths[m] if m >= 0 else "<outside>", k) for m, k in out]


__all__ = ["Breakdown", "CostModel", "Kernel", "PARTS", "Priced", "device_type_of"]
