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

This module is the stage's entry and says what "the same plan" means (``signature``,
``same_as``); the parts live beside it: ``dtype_codes`` (the codes and lookup tables),
``schedule_types`` (what a replay writes), ``replay_autocast`` (the training form's walk)
and ``replay_stored`` (the deploy form's).
"""

from __future__ import annotations

import numpy as np

from autoprec.plan.dtype_codes import BF16, DTYPES, F8, FP16, FP32, OTHER, WIDTH
from autoprec.plan.replay_autocast import AutocastReplay
from autoprec.plan.replay_stored import StoredReplay
from autoprec.plan.schedule_types import Cast, QuantInput, Schedule
from autoprec.trace.ops import OpTrace


def signature(sch: Schedule, row: int = 0) -> tuple:
    """What plan ``row`` runs, as a hashable value: two policies with the same signature
    run the same kernels on the same dtypes with the same casts (the same plan; which
    notion of "the same plan" the search uses where: ``search.decode``)."""
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


def replay(trace: OpTrace, region: np.ndarray, precision: np.ndarray, wrapped: np.ndarray,
           device_type: str, form: str = "train", grad: bool = False) -> Schedule:
    """The schedule of ``trace`` under T plans given as (T, M) module arrays (compile.py),
    in the training form (autocast over fp32 masters) or the deploy form (weights stored in
    each region's dtype, no autocast: ``StoredReplay``). ``grad``: the forward of a training
    step (grad mode on: apply keeps autocast's weight-cast cache off, every call casts)."""
    cls = StoredReplay if form == "deploy" else AutocastReplay
    rep = cls(trace, region, precision, wrapped, device_type)
    rep.grad = grad
    return rep.run()


__all__ = ["BF16", "Cast", "DTYPES", "F8", "FP16", "FP32", "OTHER", "QuantInput", "Schedule",
           "WIDTH", "replay", "same_as", "signature"]
