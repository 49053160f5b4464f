"""What a replay writes (``autoprec.plan.schedule``): the schedule of T plans — per op the
dtype codes read and written (``plan.dtype_codes``) and what GEMMs compute in — and the
casts and quantisation passes the plans insert. The cost model prices it; the audit compares
it with a real forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoprec.trace.ops import OpTrace


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
    #: deploy form a consumer's input rule): each costs host time (``measure.op_times``)
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


__all__ = ["Cast", "QuantInput", "Schedule"]
