"""The memory of a training step under a plan: weights, gradients, optimizer state, and the
activations autograd saves for the backward, at the dtype each is held in.

- weights: the fp32 masters (the training form keeps them), plus each GEMM-format leaf's
  cached quantised weight (``CostModel.held_weight_bytes``, train form);
- gradients: one per trainable parameter, in the master's dtype (fp32: autocast's backward
  casts a 16-bit weight copy's gradient to the master's dtype);
- optimizer state: AdamW's ``exp_avg`` and ``exp_avg_sq``, fp32 (8 bytes per parameter);
- saved activations: what each op's autograd node saves (``plan.backward.saves``) in the
  dtype the plan reads or writes it in — a 16-bit region saves its 16-bit input copies (an
  autocast cast of an activation is a tensor of its own per consumer; a weight's cast is
  shared where autocast's cache holds it), an fp8 leaf its 1-byte quantised input; a tensor
  saved by several ops (or through views of one storage) counts once; a parameter saved in
  its own dtype is the master, already counted;
- peak: weights + optimizer state + saved activations + gradients — an upper bound that
  assumes every gradient is allocated before the saved activations are freed (the
  gradients of the last layers are made first, while the earlier activations still live).

Activation terms scale with the batch as the cost model's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoprec.plan.backward import Backward, saves
from autoprec.plan.dtype_codes import DTYPES, OTHER, WIDTH, fixed_code
from autoprec.plan.schedule_types import Schedule
from autoprec.trace.ops import OpTrace

#: AdamW's state per parameter: exp_avg and exp_avg_sq, fp32 (torch.optim.AdamW).
ADAMW_STATE_BYTES = 8.0


@dataclass(frozen=True)
class TrainMemory:
    """Bytes one plan's training step holds (``peak_bytes``: their sum, an upper bound)."""

    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def peak_bytes(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict[str, float]:
        return {"weights_mb": round(self.weights / 1e6, 3), "grads_mb": round(self.grads / 1e6, 3),
                "optimizer_mb": round(self.optimizer / 1e6, 3),
                "activations_mb": round(self.activations / 1e6, 3),
                "peak_mb": round(self.peak_bytes / 1e6, 3)}


def trainable_numel(trace: OpTrace) -> float:
    """Elements of the trainable parameters (a tied parameter once)."""
    return float(sum(v.numel for v in trace.values
                     if v.source == "param" and v.trainable and v.param))


def roots(trace: OpTrace) -> np.ndarray:
    """(values,) the value whose storage each value views (itself when not a view)."""
    root = np.arange(len(trace.values))
    for op in trace.ops:
        if op.kind == "view" and op.inputs:
            for o in op.outputs:
                root[o] = root[op.inputs[0]]
    return root


def saved_activation_bytes(sch: Schedule, bwd: Backward, numel: np.ndarray) -> np.ndarray:
    """(T,) bytes of the tensors autograd saves for the backward under each plan (the module
    docstring says which); ``numel`` (values,) elements at the priced batch."""
    tr, t = sch.trace, sch.plans
    vals = tr.values
    floating = np.array([fixed_code(v.dtype) != OTHER for v in vals], dtype=bool)
    root = roots(tr)
    event_of = {idx: ev for ev, (what, idx) in enumerate(tr.events) if what == 0}
    cast_at: dict[tuple[int, int], np.ndarray] = {}
    for c in sch.casts:
        if c.site == "input":
            key = (c.event, c.value)
            cast_at[key] = cast_at.get(key, np.zeros(t, dtype=bool)) | c.on
    own = np.zeros(t)  # tensors of their own: an activation's cast or quantised copy
    shared: dict[int, np.ndarray] = {}  # root -> (dtype codes, T) bool: saved in that dtype
    ncodes = len(DTYPES)

    def mark(v: int, codes: np.ndarray, copy: np.ndarray) -> None:
        nonlocal own
        codes = np.asarray(codes, dtype=np.int64)
        width = np.where(codes == OTHER, vals[v].itemsize, WIDTH[codes])
        param = np.bool_(vals[v].source == "param")
        master = param & (codes == fixed_code(vals[v].dtype)) & ~copy
        alone = copy & ~param
        own = own + np.where(alone, numel[v] * width, 0.0)
        rest = ~alone & ~master
        if rest.any():
            m = shared.setdefault(int(root[v]), np.zeros((ncodes, t), dtype=bool))
            m[codes, np.arange(t)] |= rest

    for i, op in enumerate(tr.ops):
        if op.kind in ("view", "factory") or not any(bwd.needs_grad[o] for o in op.outputs):
            continue
        sin, sout = saves(op, tr, floating, bwd.needs_grad)
        reads, writes = sch.reads[i], sch.writes[i]
        ev = event_of.get(i, -1)
        for k in sin:
            v = op.inputs[k]
            copy = cast_at.get((ev, v), np.zeros(t, dtype=bool))
            if floating[v] and vals[v].source != "param":
                copy = copy | _quantised(reads[k])
            mark(v, reads[k], copy)
        for j in sout:
            if j < len(op.outputs):
                mark(op.outputs[j], writes[j], np.zeros(t, dtype=bool))
    total = own
    for r, m in shared.items():
        for code in np.flatnonzero(m.any(axis=1)):
            w = vals[r].itemsize if code == OTHER else WIDTH[code]
            total = total + np.where(m[code], numel[r] * w, 0.0)
    return total


def _quantised(codes: np.ndarray) -> np.ndarray:
    """(T,) the operand is read in a GEMM format's dtype (fp8 or a block format): its
    quantised copy is a tensor of its own."""
    codes = np.asarray(codes, dtype=np.int64)
    return (codes == DTYPES.index("fp8")) | (codes > OTHER)


__all__ = ["ADAMW_STATE_BYTES", "TrainMemory", "roots", "saved_activation_bytes",
           "trainable_numel"]
