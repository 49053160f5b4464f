"""The replay in the deploy form: weights stored in each region's dtype, no autocast
(``plan.schedule.replay`` with ``form="deploy"``; the rules are ``lower.stored``'s)."""

from __future__ import annotations

import numpy as np

from autoprec.formats.precisions import PRECISIONS
from autoprec.plan.dtype_codes import CASTABLE, FP32, IS_FMT, IS_LOW, MIXED_NORMS, STORAGE
from autoprec.plan.replay_autocast import AutocastReplay, where
from autoprec.plan.schedule_types import Cast
from autoprec.trace.ops import OpTrace


class StoredReplay(AutocastReplay):
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
        st = STORAGE[self.region]
        self.mixed = ~(st == st[:, :1]).all(axis=1)
        self.consumer = np.array([k != "" for k in self.kinds], dtype=bool)  # (M,)
        #: value -> module indices of its owners, for tensors tied between modules (each
        #: owner stores its own copy in its dtype; an op in an owner reads that copy)
        self.tied: dict[int, set[int]] = {}
        for v, val in enumerate(self.vals):
            # fp32, bf16 or fp16 as traced (a 16-bit model is traced as it is): each owner
            # stores it in its region's dtype
            if val.source != "param" or not self.floating[v] or not CASTABLE[self.state[v, 0]]:
                continue
            owner = index.get(val.param.rpartition(".")[0], 0)
            self.state[v] = STORAGE[self.region[:, owner]]
            if val.owners:
                self.tied[v] = {index[p] for p in val.owners if p in index}

    def op(self, ev: int, idx: int) -> None:
        op = self.trace.ops[idx]
        for v in op.inputs:
            if v in self.tied and op.module in self.tied[v]:
                self.state[v] = STORAGE[self.region[:, op.module]]
        back = (self.norm_params(ev, op, op.module)
                if op.module >= 0 and self.kinds[op.module] == "norm"
                and op.name in MIXED_NORMS else [])
        super().op(ev, idx)
        for v, old in back:
            self.state[v] = old
        m = op.module
        if op.kind in ("gemm", "attention") and m >= 0:
            self._rule_holds(op, m)
        if op.kind == "gemm" and m >= 0:  # a GEMM-format leaf gives its region's dtype
            fmt = IS_FMT[self.precision[:, m]]
            if fmt.any():
                out = np.where(fmt, STORAGE[self.region[:, m]], self.sch.writes[-1]
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
        off = ~IS_FMT[self.precision[:, m]] & (comp != r)
        if off.any():
            row = int(np.flatnonzero(off)[0])
            self.fail(off, f"{op.name} in {where(self.trace, op.module)} computes in "
                           f"{PRECISIONS[int(comp[row])]} (the dtype its operands arrive in: "
                           "the deploy form casts no module's output back), but its rule "
                           f"says {PRECISIONS[int(r[row])]}; give the modules feeding it the "
                           "same rule")

    def enter(self, ev: int, idx: int) -> None:
        call = self.trace.calls[idx]
        m = call.module
        saved: dict[int, np.ndarray] = {}
        if m >= 0:
            dst = STORAGE[self.region[:, m]]
            fmt = IS_FMT[self.precision[:, m]]
            on_m = self.wrapped[:, m] & ~fmt  # rows where it enters a region of its own
            kind = self.kinds[m]
            # rows where it runs inside its caller's region by its own input rule
            inside = (~on_m & ~fmt & self.mixed) if kind else np.zeros(self.t, dtype=bool)
            cons = np.full(self.t, FP32, np.int8) if kind == "norm" else dst
            for v in dict.fromkeys(call.inputs):
                if not self.floating[v]:
                    continue
                st = self.state[v]
                need = CASTABLE[st] & (st != dst)
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
            on = up & IS_LOW[self.state[v]]
            if on.any():
                back.append((v, self.state[v].copy()))
                self.sch.casts.append(Cast("input", ev, v, self.state[v].copy(),
                                           np.full(self.t, FP32, np.int8), on, weight=True))
                self.state[v] = np.where(on, FP32, self.state[v])
        return back

    def _cast_to(self, ev: int, v: int, on: np.ndarray, dst: np.ndarray, site: str) -> None:
        self.sch.casts.append(Cast(site, ev, v, self.state[v].copy(), dst.copy(), on))
        self.state[v] = np.where(on, dst, self.state[v])


__all__ = ["StoredReplay"]
