"""The replay in the training form: autocast over fp32 masters (``plan.schedule.replay``).

One walk over the recorded events of a forward (``autoprec.trace.ops``) for T plans at once,
deciding as torch.autocast and apply's wrappers would on a device type: ``lower`` ops cast
every floating input to the region's dtype (weights too), ``fp32`` ops cast 16-bit inputs to
fp32, a wrapped fp32 island upcasts its inputs and its 16-bit outputs go back to a fp32
caller as fp32; a GEMM-format leaf quantises its activation input. The deploy form
(``plan.replay_stored``) subclasses this walk.
"""

from __future__ import annotations

import numpy as np

from autoprec.lower.autocast import cast_policy
from autoprec.plan.compile import CODE
from autoprec.plan.dtype_codes import (
    DTYPE_PREC,
    FP32,
    IS_FMT,
    IS_LOW,
    MIXED_NORMS,
    OPERAND_OF,
    OTHER,
    PROMOTE,
    REGION_DTYPE,
    STORAGE,
    fixed_code,
)
from autoprec.plan.schedule_types import Cast, QuantInput, Schedule
from autoprec.trace.ops import OpTrace


class AutocastReplay:
    """One walk over the recorded events; ``state`` holds every value's dtype per plan."""

    stored = False  # the deploy form (``StoredReplay``)
    grad = False  # a training step's forward: no weight-cast cache (``lower.forward``)

    def __init__(self, trace: OpTrace, region: np.ndarray, precision: np.ndarray,
                 wrapped: np.ndarray, device_type: str) -> None:
        self.trace = trace
        self.region = np.atleast_2d(region)
        self.precision = np.atleast_2d(precision)
        self.wrapped = np.atleast_2d(wrapped)
        self.device_type = device_type
        t = self.t = self.region.shape[0]
        vals = self.vals = trace.values
        self.state = np.array([[fixed_code(v.dtype)] * t for v in vals],
                              dtype=np.int8).reshape(len(vals), t)
        self.floating = np.array([fixed_code(v.dtype) != OTHER for v in vals], dtype=bool)
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
        if not self.stored and not self.grad:
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
        return PROMOTE[mask]

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
                      & ~IS_FMT[self.precision[:, m]])
            for v in call.inputs:
                on = island & IS_LOW[self.state[v]] if self.floating[v] else None
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
            on = to_fp32 & IS_LOW[self.state[v]] if self.floating[v] else None
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
                                  self.vals, r, ac, REGION_DTYPE[r],
                                  self.precision[:, m] if m >= 0 else None, self.fail)
        elif policy in ("fp32", "fp32_opt", "promote") and ac.any():
            out = self._fp32_or_promote(ev, op, ins, reads, policy, ac, REGION_DTYPE[r])
        elif op.like is not None:
            out = state[op.like].copy()
        elif op.fixed_dtype is not None:
            out = np.full(t, fixed_code(op.fixed_dtype), np.int8)
        elif self.device_type == "cpu" and op.name in MIXED_NORMS and ins:
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
            out = STORAGE[self.region[:, max(op.module, 0)]].astype(np.int8)
        else:
            out = state[op.like].copy() if op.like is not None else np.full(
                self.t, fixed_code(op.fixed_dtype), np.int8)
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
                other |= IS_LOW[state[ins[k]]] & (state[ins[k]] != tgt)
            self.fail(ac & other, f"{op.name} in {where(self.trace, op.module)} gets a "
                                  "16-bit input other than its autocast region's dtype "
                                  "(autocast's promote ops refuse that)")
        else:
            want = np.full(t, FP32, np.int8)
        plain = op.fixed_dtype is not None and policy != "promote"
        base = np.full(t, fixed_code(op.fixed_dtype), np.int8) if plain else self.promote(ins)
        if policy != "fp32_opt":  # fp32 / promote: separate cast kernels first
            for k in flo:
                on = ac & (state[ins[k]] != want) & (state[ins[k]] != OTHER)
                if on.any():
                    self.sch.casts.append(Cast("input", ev, ins[k], state[ins[k]].copy(),
                                               want.copy(), on,
                                               weight=vals[ins[k]].source == "param"))
                    reads[k] = np.where(on, want, reads[k])
        return np.where(ac, want, base).astype(np.int8)


def where(trace: OpTrace, m: int) -> str:
    return repr(trace.modules[m] or "<root>") if m >= 0 else "the forward function"


def _lower(sch: Schedule, ev: int, idx: int, op, ins, reads, state, floating, vals, r, ac,
           tgt, prec, fail):  # noqa: ANN001 - internal helper of replay
    """A GEMM/SDPA: autocast casts every floating input to the region's dtype; a GEMM-format
    leaf's GEMM (``prec`` fp8/mxfp8/nvfp4) quantises its activation input and reads the
    weight quantised once (cached); outside autocast every operand must share one dtype."""
    t = r.shape[0]
    flo = [k for k, i in enumerate(ins) if floating[i]]
    fmt = (IS_FMT[prec] if prec is not None and op.kind == "gemm"
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
    fail(~ac & ~fmt & mixed, f"{op.name} in {where(sch.trace, op.module)} gets operands of "
                             "different dtypes outside autocast")
    plain = np.where((r == 1) & (first == FP32), 1, DTYPE_PREC[first])  # tf32 region
    compute = np.where(ac, DTYPE_PREC[tgt], plain).astype(np.int8)
    out = np.where(ac, tgt, first).astype(np.int8)
    if fmt.any():
        compute = np.where(fmt, prec, compute).astype(np.int8)
        operand = OPERAND_OF[prec]
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



__all__ = ["AutocastReplay"]
