"""Replay a recorded forward under plans: the dtype of every tensor, and every cast.

``replay(trace, region, precision, wrapped, device_type)`` walks the ops and module calls
of one recorded fp32 forward (``autoprec.trace.ops``) for T plans at once (numpy rows) and
decides, as torch.autocast and apply's wrappers would on ``device_type``:

- the dtype every value carries (``state``: fp32 / bf16 / fp16 / ...);
- for every op, the dtype each input is read in and each output written in, and for
  GEMMs the precision they compute in (fp8 for an fp8 leaf's GEMM, tf32 in a tf32 region);
- every cast that runs: autocast's input casts (``lower`` ops cast every floating input to
  the region's dtype — weights too: once per forward where the plan has one 16-bit dtype
  (autocast's cast cache on), on every call where it has two; ``fp32`` ops cast 16-bit
  inputs to fp32), a fp32 island's input
  casts, the casts of 16-bit outputs returning to a fp32 caller, and the model's own
  explicit casts (``x.float()``) where they change the dtype;
- plans that cannot run (a GEMM fed mixed dtypes outside autocast, autocast's promote ops
  fed bf16 with fp16), with the reason.

The wrapper rules are compile.py's; the cast policies per op are lower/autocast.py's. The cost
model (``autoprec.cost``) prices the result; the audit compares it with a real forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoprec.formats.gemm import BLOCK_SCALED
from autoprec.lower.autocast import cast_policy
from autoprec.plan.compile import CODE, FORMAT_CODES
from autoprec.precisions import BYTES, GEMM_FORMATS, PRECISIONS
from autoprec.trace.ops import OpTrace

#: Value dtype codes ("fp8": a float8 tensor, trace.ops' name), then one per block-scaled
#: format (codes 6, 7...), only as what a block-scaled GEMM reads its operands in.
FP32, BF16, FP16, F8, FP64, OTHER = range(6)
DTYPES = ("fp32", "bf16", "fp16", "fp8", "fp64", "other", *BLOCK_SCALED)
_CODE = {n: i for i, n in enumerate(DTYPES[:6])}
#: Bytes per element of each code (OTHER: the value's own itemsize); block formats with
#: their scales (``GemmFormat.bytes_per_element``).
WIDTH = np.array([4, 2, 2, 1, 8, 0, *(BYTES[f] for f in BLOCK_SCALED)], dtype=float)
#: Region code (fp32, tf32, bf16, fp16) -> the dtype its autocast produces (fp32: none).
_REGION_DTYPE = np.array([FP32, FP32, BF16, FP16, *[FP32] * len(GEMM_FORMATS)], dtype=np.int8)
#: dtype code -> the precision code a GEMM on it computes in (fp32 -> fp32; tf32 by region).
_DTYPE_PREC = np.array([CODE["fp32"], CODE["bf16"], CODE["fp16"], CODE["fp8"], CODE["fp32"],
                        CODE["fp32"], *(CODE[f] for f in BLOCK_SCALED)], dtype=np.int8)
#: GEMM format precision code -> the dtype code its quantised operands are read in.
#: (the per-tensor fp8 reads float8 tensors, F8; each block format its own code, by name)
_OPERAND = {CODE[f]: DTYPES.index(f) for f in GEMM_FORMATS}


def _promotion_table() -> np.ndarray:
    """Result dtype of PyTorch's type promotion over a set of floating dtypes (bit mask)."""
    out = np.full(64, OTHER, dtype=np.int8)
    for mask in range(64):
        has = {c for c in range(6) if mask >> c & 1}
        floats = has - {OTHER}
        if FP64 in floats:
            out[mask] = FP64
        elif FP32 in floats or {BF16, FP16} <= floats:
            out[mask] = FP32
        elif BF16 in floats:
            out[mask] = BF16
        elif FP16 in floats:
            out[mask] = FP16
        elif F8 in floats:
            out[mask] = F8
    return out


_PROMOTE = _promotion_table()
#: Norms whose output has their input's dtype whatever the dtype of their weight and bias
#: (aten's mixed-type norm kernels on a CPU: bf16 input, fp32 affine -> bf16 output).
_MIXED_NORMS = frozenset({"native_layer_norm", "native_group_norm", "native_batch_norm",
                          "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"})


@dataclass
class Cast:
    """A cast the plan inserts (input of an op, fp32 island entry, return to fp32)."""

    site: str  # "input" | "enter" | "exit"
    event: int  # index into trace.events
    value: int  # value id
    src: np.ndarray  # (T,) dtype code before
    dst: np.ndarray  # (T,) dtype code after
    on: np.ndarray  # (T,) bool: runs in that plan
    weight: bool = False  # the value is a parameter (or a view of one)


@dataclass
class QuantInput:
    """The quantisation of a GEMM-format GEMM's activation input: fp8 current scaling
    (amax, scale, cast to e4m3), MXFP8 (one fused block pass), NVFP4 (tensor amax, then a
    fused block pass). The cost model prices each format's passes."""

    op: int
    value: int
    src: np.ndarray  # (T,) dtype the input arrives in
    on: np.ndarray  # (T,) bool
    fmt: np.ndarray  # (T,) GEMM format precision code (where on)


@dataclass
class Schedule:
    """Per-op dtypes and the inserted casts for T plans (rows)."""

    trace: OpTrace
    device_type: str
    plans: int
    reads: list[np.ndarray] = field(default_factory=list)  # per op: (n_in, T) dtype codes
    writes: list[np.ndarray] = field(default_factory=list)  # per op: (n_out, T)
    compute: list[np.ndarray | None] = field(default_factory=list)  # GEMMs: (T,) precision
    kernel: list[np.ndarray | bool] = field(default_factory=list)  # launches a kernel
    casts: list[Cast] = field(default_factory=list)
    quant_inputs: list[QuantInput] = field(default_factory=list)
    invalid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    reasons: dict[int, str] = field(default_factory=dict)  # plan row -> why it cannot run
    #: (T,) calls through a wrapper apply installs (a wrapped module's forward, and in the
    #: deploy form a consumer's input rule): each costs host time (``cost.op_times``)
    wrapper_calls: np.ndarray = field(default_factory=lambda: np.zeros(0))
    form: str = "train"

    def cast_count(self, row: int = 0, weights: bool = False) -> int:
        """Casts one forward of plan ``row`` runs (weights: autocast's per-call weight casts
        only; else activation casts, explicit casts of the model's code included)."""
        n = sum(1 for c in self.casts if c.weight == weights and c.on[row])
        if not weights:
            n += sum(1 for i, op in enumerate(self.trace.ops) if op.kind == "cast"
                     and bool(np.broadcast_to(np.asarray(self.kernel[i]), (self.plans,))[row]))
        return n


def signature(sch: Schedule, row: int = 0) -> tuple:
    """What plan ``row`` runs, as a hashable value: two policies with the same signature
    run the same kernels on the same dtypes with the same casts (the same plan)."""
    ops = tuple((tuple(int(c) for c in sch.reads[i][:, row]),
                 tuple(int(c) for c in sch.writes[i][:, row]),
                 None if sch.compute[i] is None else int(sch.compute[i][row]),
                 bool(np.broadcast_to(np.asarray(sch.kernel[i]), (sch.plans,))[row]))
                for i in range(len(sch.reads)))
    casts = tuple(sorted((c.site, c.event, c.value, int(c.src[row]), int(c.dst[row]))
                         for c in sch.casts if c.on[row]))
    fp8 = tuple(sorted((f.op, f.value, int(f.src[row]), int(f.fmt[row]))
                       for f in sch.quant_inputs if f.on[row]))
    return ops, casts, fp8, bool(sch.invalid[row])


def same_as(sch: Schedule, ref: int = 0) -> np.ndarray:
    """(T,) bool: plan row runs what row ``ref`` runs — ``signature`` equality for every
    row at once (vectorised; False also where two rows differ only in the order of casts
    of one value at one event, which the replay never produces)."""
    ok = sch.invalid == sch.invalid[ref]
    for i in range(len(sch.reads)):
        ok &= (sch.reads[i] == sch.reads[i][:, ref:ref + 1]).all(axis=0)
        ok &= (sch.writes[i] == sch.writes[i][:, ref:ref + 1]).all(axis=0)
        comp = sch.compute[i]
        if comp is not None:
            ok &= comp == comp[ref]
        kern = sch.kernel[i]
        if isinstance(kern, np.ndarray) and kern.ndim:
            ok &= kern == kern[ref]
    for c in sch.casts:
        ok &= (c.on == c.on[ref]) & (~c.on | ((c.src == c.src[ref]) & (c.dst == c.dst[ref])))
    for f in sch.quant_inputs:
        ok &= (f.on == f.on[ref]) & (~f.on | ((f.src == f.src[ref]) & (f.fmt == f.fmt[ref])))
    return ok


def _fixed(name: str | None) -> int:
    return _CODE.get(name or "", OTHER)


def replay(trace: OpTrace, region: np.ndarray, precision: np.ndarray, wrapped: np.ndarray,
           device_type: str, form: str = "train") -> Schedule:
    """The schedule of ``trace`` under T plans given as (T, M) module arrays (compile.py),
    in the training form (autocast over fp32 masters) or the deploy form (weights stored in
    each region's dtype, no autocast: ``_StoredReplay``)."""
    cls = _StoredReplay if form == "deploy" else _Replay
    return cls(trace, region, precision, wrapped, device_type).run()


_LOW = np.array([BF16, FP16], dtype=np.int8)
#: Lookup tables (np.isin costs ~10 us a call; a gather ~1 us): dtype code -> 16-bit;
#: precision code -> a GEMM format.
_IS_LOW = np.isin(np.arange(len(DTYPES)), _LOW)
_IS_FMT = np.isin(np.arange(len(CODE)), FORMAT_CODES)
#: Precision code -> the dtype code a GEMM format's operands are read in (F8 elsewhere).
_OPERAND_OF = np.array([_OPERAND.get(c, F8) for c in range(len(CODE))], dtype=np.int8)


class _Replay:
    """One walk over the recorded events; ``state`` holds every value's dtype per plan."""

    stored = False  # the deploy form (``_StoredReplay``)

    def __init__(self, trace: OpTrace, region: np.ndarray, precision: np.ndarray,
                 wrapped: np.ndarray, device_type: str) -> None:
        self.trace = trace
        self.region = np.atleast_2d(region)
        self.precision = np.atleast_2d(precision)
        self.wrapped = np.atleast_2d(wrapped)
        self.device_type = device_type
        t = self.t = self.region.shape[0]
        vals = self.vals = trace.values
        self.state = np.array([[_fixed(v.dtype)] * t for v in vals],
                              dtype=np.int8).reshape(len(vals), t)
        self.floating = np.array([_fixed(v.dtype) != OTHER for v in vals], dtype=bool)
        self.sch = Schedule(trace, device_type, t, invalid=np.zeros(t, dtype=bool))
        self.ac_region = np.isin(self.region, (2, 3))  # (T, M)
        self.policies = [cast_policy(op.name, device_type) for op in trace.ops]
        self.stack: list[tuple[int, int, dict[int, np.ndarray]]] = []  # call, module, saved

    def run(self) -> Schedule:
        for ev, (what, idx) in enumerate(self.trace.events):
            if what == 1:
                self.enter(ev, idx)
            elif what == 2:
                self.leave(ev)
            else:
                self.op(ev, idx)
        if not self.stored:
            self._cached_weight_casts()
        self.sch.wrapper_calls = (self.wrappers() * self.calls()).sum(axis=1)
        self.sch.form = "deploy" if self.stored else "train"
        return self.sch

    def calls(self) -> np.ndarray:
        """(M,) recorded forward calls of each module."""
        mods = [c.module for c in self.trace.calls if c.module >= 0]
        return np.bincount(np.asarray(mods, dtype=np.intp),
                           minlength=len(self.trace.modules))[:len(self.trace.modules)]

    def wrappers(self) -> np.ndarray:
        """(T, M) bool: the module's forward runs through a wrapper apply installs."""
        return self.wrapped.astype(bool)

    def _cached_weight_casts(self) -> None:
        """A plan whose autocast regions have one 16-bit dtype runs (under ``no_grad``, the
        forward priced) with autocast's cast cache on (``lower.forward.lowered_forward``):
        a parameter read twice in one forward (a module called twice) is cast once. Views
        of parameters are not cached."""
        both = (self.region == CODE["bf16"]).any(axis=1) & (self.region == CODE["fp16"]).any(axis=1)
        one = ~both  # (T,)
        if not one.any():
            return
        seen: dict[tuple[int, int], np.ndarray] = {}
        for c in self.sch.casts:
            if not c.weight or not self.vals[c.value].param:
                continue
            for dst in np.unique(c.dst[c.on & one]):
                done = seen.setdefault((c.value, int(dst)), np.zeros(self.t, dtype=bool))
                mine = c.on & one & (c.dst == dst)
                c.on = c.on & ~(mine & done)
                done |= mine

    def fail(self, mask: np.ndarray, why: str) -> None:
        sch = self.sch
        for row in np.flatnonzero(mask & ~sch.invalid):
            sch.reasons[int(row)] = why
        sch.invalid |= mask

    def promote(self, ids: list[int]) -> np.ndarray:
        """PyTorch's type promotion over the floating values ``ids`` (0-dim ones only when
        no value with dims is floating)."""
        flo = [i for i in ids if self.floating[i]]
        big = [i for i in flo if self.vals[i].ndim > 0] or flo
        if not big:
            return np.full(self.t, OTHER, dtype=np.int8)
        mask = np.zeros(self.t, dtype=np.int64)
        for i in big:
            mask |= np.left_shift(1, self.state[i].astype(np.int64))
        return _PROMOTE[mask]

    def _cast_to_fp32(self, site: str, ev: int, v: int, on: np.ndarray) -> None:
        self.sch.casts.append(Cast(site, ev, v, self.state[v].copy(),
                                   np.full(self.t, FP32, np.int8), on))
        self.state[v] = np.where(on, FP32, self.state[v])

    # -- module calls ------------------------------------------------------------------------
    def enter(self, ev: int, idx: int) -> None:
        """A wrapped fp32/tf32 module upcasts its 16-bit inputs (its caller keeps them)."""
        call = self.trace.calls[idx]
        m = call.module
        saved: dict[int, np.ndarray] = {}
        if m >= 0:
            island = (self.wrapped[:, m] & ~self.ac_region[:, m]
                      & ~_IS_FMT[self.precision[:, m]])
            for v in call.inputs:
                on = island & _IS_LOW[self.state[v]] if self.floating[v] else None
                if on is not None and on.any():
                    saved[v] = self.state[v].copy()
                    self._cast_to_fp32("enter", ev, v, on)
        self.stack.append((idx, m, saved))

    def leave(self, ev: int) -> None:
        """Back in the caller: 16-bit outputs become fp32 when the caller's region is fp32/
        tf32 (autocast off); an autocast caller takes them as they are."""
        cidx, m, saved = self.stack.pop()
        call = self.trace.calls[cidx]
        for v, old in saved.items():
            if v not in call.outputs:
                self.state[v] = old
        caller = self.stack[-1][1] if self.stack else -1
        if m < 0 or caller < 0:
            return  # the root returns to the user's code as it is
        to_fp32 = self.wrapped[:, m] & ~self.ac_region[:, caller]
        for v in call.outputs:
            on = to_fp32 & _IS_LOW[self.state[v]] if self.floating[v] else None
            if on is not None and on.any():
                self._cast_to_fp32("exit", ev, v, on)

    # -- ops ---------------------------------------------------------------------------------
    def op(self, ev: int, idx: int) -> None:
        op = self.trace.ops[idx]
        m, t, state = op.module, self.t, self.state
        r = self.region[:, m] if m >= 0 else np.zeros(t, dtype=np.intp)  # outside: fp32
        ac = self.ac_region[:, m] if m >= 0 else np.zeros(t, dtype=bool)
        ins = list(op.inputs)
        reads = state[ins] if ins else np.empty((0, t), dtype=np.int8)  # (n_in, T) copy
        policy = self.policies[idx]
        compute: np.ndarray | None = None
        kernel: np.ndarray | bool = op.kind != "view"
        if op.kind == "view":
            out = state[ins[0]].copy() if ins else np.full(t, OTHER, np.int8)
        elif op.kind == "cast":
            out, kernel = self._explicit_cast(op, ins)
        elif policy == "lower" and op.kind in ("gemm", "attention"):
            out, compute = _lower(self.sch, ev, idx, op, ins, reads, state, self.floating,
                                  self.vals, r, ac, _REGION_DTYPE[r],
                                  self.precision[:, m] if m >= 0 else None, self.fail)
        elif policy in ("fp32", "fp32_opt", "promote") and ac.any():
            out = self._fp32_or_promote(ev, op, ins, reads, policy, ac, _REGION_DTYPE[r])
        elif op.like is not None:
            out = state[op.like].copy()
        elif op.fixed_dtype is not None:
            out = np.full(t, _fixed(op.fixed_dtype), np.int8)
        elif self.device_type == "cpu" and op.name in _MIXED_NORMS and ins:
            out = state[ins[0]].copy()  # CPU autocast's bf16 LayerNorm feeds on as bf16
        else:
            out = self.promote(ins)
        for o in op.outputs:
            if self.floating[o]:
                state[o] = out
        sch = self.sch
        sch.reads.append(reads)
        sch.writes.append(np.repeat(np.asarray(out, dtype=np.int8).reshape(1, t),
                                    len(op.outputs), axis=0))
        sch.compute.append(compute)
        sch.kernel.append(kernel)

    def _explicit_cast(self, op, ins: list[int]) -> tuple[np.ndarray, np.ndarray | bool]:  # noqa: ANN001
        """The model's own ``.float()`` / ``.to(dtype)``: a kernel only where it changes the
        dtype (a no-op cast of an fp32 tensor is free; under a 16-bit plan it is not)."""
        state = self.state
        if op.ambient and self.stored:
            # a 16-bit model's cast to its own dtype (trace.ops.Op.ambient): to the storage
            # dtype of the region it runs in, as the applied plan's tensors make it
            out = _STORAGE[self.region[:, max(op.module, 0)]].astype(np.int8)
        else:
            out = state[op.like].copy() if op.like is not None else np.full(
                self.t, _fixed(op.fixed_dtype), np.int8)
        if ins and self.floating[ins[0]]:
            return out, out != state[ins[0]]
        src = self.vals[ins[0]].dtype if ins else None  # int mask -> bool / float: as traced
        return out, src is None or src != (op.fixed_dtype or src)

    def _fp32_or_promote(self, ev: int, op, ins: list[int], reads: np.ndarray, policy: str,  # noqa: ANN001
                         ac: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        """Autocast's fp32 / fp32_set_opt_dtype / promote policies in the autocast rows;
        plain type promotion elsewhere."""
        t, state, vals = self.t, self.state, self.vals
        flo = [k for k, i in enumerate(ins) if self.floating[i]]
        if policy == "promote":
            want = self.promote(ins)
            # autocast's prioritize(): a 16-bit input other than the region's dtype
            other = np.zeros(t, dtype=bool)
            for k in flo:
                other |= _IS_LOW[state[ins[k]]] & (state[ins[k]] != tgt)
            self.fail(ac & other, f"{op.name} in {_where(self.trace, op.module)} gets a "
                                  "16-bit input other than its autocast region's dtype "
                                  "(autocast's promote ops refuse that)")
        else:
            want = np.full(t, FP32, np.int8)
        plain = op.fixed_dtype is not None and policy != "promote"
        base = np.full(t, _fixed(op.fixed_dtype), np.int8) if plain else self.promote(ins)
        if policy != "fp32_opt":  # fp32 / promote: separate cast kernels first
            for k in flo:
                on = ac & (state[ins[k]] != want) & (state[ins[k]] != OTHER)
                if on.any():
                    self.sch.casts.append(Cast("input", ev, ins[k], state[ins[k]].copy(),
                                               want.copy(), on,
                                               weight=vals[ins[k]].source == "param"))
                    reads[k] = np.where(on, want, reads[k])
        return np.where(ac, want, base).astype(np.int8)


def _where(trace: OpTrace, m: int) -> str:
    return repr(trace.modules[m] or "<root>") if m >= 0 else "the forward function"


def _lower(sch: Schedule, ev: int, idx: int, op, ins, reads, state, floating, vals, r, ac,
           tgt, prec, fail):  # noqa: ANN001 - internal helper of replay
    """A GEMM/SDPA: autocast casts every floating input to the region's dtype; a GEMM-format
    leaf's GEMM (``prec`` fp8/mxfp8/nvfp4) quantises its activation input and reads the
    weight quantised once (cached); outside autocast every operand must share one dtype."""
    t = r.shape[0]
    flo = [k for k, i in enumerate(ins) if floating[i]]
    fmt = (_IS_FMT[prec] if prec is not None and op.kind == "gemm"
           else np.zeros(t, dtype=bool))
    params = {k for k in flo if vals[ins[k]].source == "param"}
    acts = [k for k in flo if k not in params]
    for k in flo:
        on = ac & ~fmt & (state[ins[k]] != tgt)
        if on.any():
            sch.casts.append(Cast("input", ev, ins[k], state[ins[k]].copy(), tgt.copy(), on,
                                  weight=k in params))
        reads[k] = np.where(ac & ~fmt, tgt, reads[k])
    # outside autocast: one common dtype, else the op raises (mat1 and mat2 ...)
    first = state[ins[flo[0]]] if flo else np.full(t, FP32, np.int8)
    mixed = np.zeros(t, dtype=bool)
    for k in flo:
        mixed |= state[ins[k]] != first
    fail(~ac & ~fmt & mixed, f"{op.name} in {_where(sch.trace, op.module)} gets operands of "
                             "different dtypes outside autocast")
    plain = np.where((r == 1) & (first == FP32), 1, _DTYPE_PREC[first])  # tf32 region
    compute = np.where(ac, _DTYPE_PREC[tgt], plain).astype(np.int8)
    out = np.where(ac, tgt, first).astype(np.int8)
    if fmt.any():
        compute = np.where(fmt, prec, compute).astype(np.int8)
        operand = _OPERAND_OF[prec]
        x = acts[0] if acts else (flo[0] if flo else 0)
        for k in flo:
            quantised = k == x or (k in params and vals[ins[k]].ndim >= 2)  # not the bias
            if quantised:
                reads[k] = np.where(fmt, operand, reads[k])
        if acts:
            sch.quant_inputs.append(QuantInput(idx, ins[x], state[ins[x]].copy(), fmt.copy(),
                                               np.where(fmt, prec, -1)))
        out = np.where(fmt, np.where(ac, tgt, state[ins[x]]), out).astype(np.int8)
    return out, compute


#: Region code -> the dtype code its tensors are stored in under the deploy form.
_STORAGE = np.array([FP32, FP32, BF16, FP16, *[FP32] * len(GEMM_FORMATS)], dtype=np.int8)
_CASTABLE = np.isin(np.arange(len(DTYPES)), (FP32, BF16, FP16))


class _StoredReplay(_Replay):
    """The deploy form (``lower.stored``): no autocast anywhere; every parameter and
    floating buffer carries its owner's storage dtype (a GEMM-format leaf's weight is read
    quantised, its bias in the region's dtype); a wrapped module casts its floating inputs
    to its storage dtype on entry, nothing on exit; inside a region, a module holding
    weights casts its inputs to them and a norm computes in the wider of its input's and
    its weights' dtype (``trace.consumers``). Every op then runs in the dtype type
    promotion gives it."""

    stored = True

    def __init__(self, trace: OpTrace, region: np.ndarray, precision: np.ndarray,
                 wrapped: np.ndarray, device_type: str) -> None:
        super().__init__(trace, region, precision, wrapped, device_type)
        self.ac_region = np.zeros_like(self.ac_region)  # autocast is off in every region
        index = {p: i for i, p in enumerate(trace.modules)}
        self.kinds = trace.consumers or [""] * len(trace.modules)
        # (T,) plans whose regions store more than one dtype: only there do consumers cast
        # (apply installs their input rules only then, lower.stored)
        st = _STORAGE[self.region]
        self.mixed = ~(st == st[:, :1]).all(axis=1)
        self.consumer = np.array([k != "" for k in self.kinds], dtype=bool)  # (M,)
        #: value -> module indices of its owners, for tensors tied between modules (each
        #: owner stores its own copy in its dtype; an op in an owner reads that copy)
        self.tied: dict[int, set[int]] = {}
        for v, val in enumerate(self.vals):
            # fp32, bf16 or fp16 as traced (a 16-bit model is traced as it is): each owner
            # stores it in its region's dtype
            if val.source != "param" or not self.floating[v] or not _CASTABLE[self.state[v, 0]]:
                continue
            owner = index.get(val.param.rpartition(".")[0], 0)
            self.state[v] = _STORAGE[self.region[:, owner]]
            if val.owners:
                self.tied[v] = {index[p] for p in val.owners if p in index}

    def op(self, ev: int, idx: int) -> None:
        op = self.trace.ops[idx]
        for v in op.inputs:
            if v in self.tied and op.module in self.tied[v]:
                self.state[v] = _STORAGE[self.region[:, op.module]]
        back = (self.norm_params(ev, op, op.module)
                if op.module >= 0 and self.kinds[op.module] == "norm"
                and op.name in _MIXED_NORMS else [])
        super().op(ev, idx)
        for v, old in back:
            self.state[v] = old
        m = op.module
        if op.kind in ("gemm", "attention") and m >= 0:
            self._rule_holds(op, m)
        if op.kind == "gemm" and m >= 0:  # a GEMM-format leaf gives its region's dtype
            fmt = _IS_FMT[self.precision[:, m]]
            if fmt.any():
                out = np.where(fmt, _STORAGE[self.region[:, m]], self.sch.writes[-1]
                               ).astype(np.int8)
                self.sch.writes[-1] = out
                for k, o in enumerate(op.outputs):
                    if self.floating[o]:
                        self.state[o] = out[k]

    def _rule_holds(self, op, m: int) -> None:  # noqa: ANN001 - trace.ops.Op
        """A GEMM / SDPA computes in the dtype its operands arrive in (no autocast here):
        where that is not its module's rule — an attention module's SDPA ruled fp32 fed
        by bf16 q / k / v leaves, which keep their dtype on the way out — the rule would
        not run and the audit refuses the plan (``apply.audit``), so the plan cannot run
        as written. Seen: every compiled encoder4 trial spent on ``attention.self: fp32``
        over bf16 q / k / v."""
        comp = self.sch.compute[-1]
        if comp is None or not any(self.floating[v] for v in op.inputs):
            return
        r = self.region[:, m]
        off = ~_IS_FMT[self.precision[:, m]] & (comp != r)
        if off.any():
            row = int(np.flatnonzero(off)[0])
            self.fail(off, f"{op.name} in {_where(self.trace, op.module)} computes in "
                           f"{PRECISIONS[int(comp[row])]} (the dtype its operands arrive in: the deploy "
                           f"form casts no module's output back), but its rule says "
                           f"{PRECISIONS[int(r[row])]}; give the modules feeding it the same rule")

    def enter(self, ev: int, idx: int) -> None:
        call = self.trace.calls[idx]
        m = call.module
        saved: dict[int, np.ndarray] = {}
        if m >= 0:
            dst = _STORAGE[self.region[:, m]]
            fmt = _IS_FMT[self.precision[:, m]]
            on_m = self.wrapped[:, m] & ~fmt  # rows where it enters a region of its own
            kind = self.kinds[m]
            # rows where it runs inside its caller's region by its own input rule
            inside = (~on_m & ~fmt & self.mixed) if kind else np.zeros(self.t, dtype=bool)
            cons = np.full(self.t, FP32, np.int8) if kind == "norm" else dst
            for v in dict.fromkeys(call.inputs):
                if not self.floating[v]:
                    continue
                st = self.state[v]
                need = _CASTABLE[st] & (st != dst)
                on_cons = inside & need
                if kind == "norm":  # fed another dtype than its weights': in fp32
                    on_cons &= st != FP32
                on = (on_m & need) | on_cons
                if on.any():
                    saved[v] = st.copy()
                    self._cast_to(ev, v, on, np.where(on_cons, cons, dst).astype(np.int8),
                                  "enter")
        self.stack.append((idx, m, saved))

    def leave(self, ev: int) -> None:
        cidx, m, saved = self.stack.pop()
        call = self.trace.calls[cidx]
        for v, old in saved.items():
            if v not in call.outputs:
                self.state[v] = old  # the caller still holds its own dtype

    def wrappers(self) -> np.ndarray:
        """Wrapped modules, and where a plan stores two dtypes every other consumer (a
        module with weights or a norm: its input rule, ``lower.stored.consumer_forward``)."""
        own = self.wrapped.astype(bool)
        return own | (self.mixed[:, None] & self.consumer[None, :] & ~own)

    def norm_params(self, ev: int, op, m: int) -> list[tuple[int, np.ndarray]]:  # noqa: ANN001
        """A 16-bit norm fed fp32: its weight and bias cast up for the call (returns the
        params' states to put back after the op)."""
        ins = list(op.inputs)
        x = next((v for v in ins if self.floating[v] and self.vals[v].source != "param"),
                 None)
        if x is None:
            return []
        up = self.state[x] == FP32
        back = []
        for v in ins:
            if self.vals[v].source != "param" or not self.floating[v]:
                continue
            on = up & _IS_LOW[self.state[v]]
            if on.any():
                back.append((v, self.state[v].copy()))
                self.sch.casts.append(Cast("input", ev, v, self.state[v].copy(),
                                           np.full(self.t, FP32, np.int8), on, weight=True))
                self.state[v] = np.where(on, FP32, self.state[v])
        return back

    def _cast_to(self, ev: int, v: int, on: np.ndarray, dst: np.ndarray, site: str) -> None:
        self.sch.casts.append(Cast(site, ev, v, self.state[v].copy(), dst.copy(), on))
        self.state[v] = np.where(on, dst, self.state[v])


__all__ = ["BF16", "Cast", "DTYPES", "F8", "FP16", "FP32", "OTHER", "QuantInput", "Schedule",
           "WIDTH", "replay", "same_as", "signature"]
