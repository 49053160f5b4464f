"""The backward of a replayed forward: every gradient kernel a training step runs, per plan.

``backward(schedule, fp8_backward)`` derives, from the schedule of one recorded forward under
T plans (``plan.schedule.replay``, the training form), the kernels ``loss.backward()`` runs,
as autograd runs them:

- a GEMM (Linear, conv, matmul): one gradient GEMM per matrix operand that needs a gradient,
  with the forward's FLOPs each — **dgrad** for an activation, **wgrad** for a parameter
  (``dY @ W`` and ``dY^T @ X`` for a Linear) — at the precision the forward computed in
  (a 16-bit autocast GEMM's gradient arrives 16-bit; a tf32 region's backward runs fp32:
  apply enables tf32 inside the forward's ``with`` block only); a bias's gradient is a
  reduction over ``dY`` (wgrad);
- a GEMM-format leaf (fp8 / mxfp8 / nvfp4): ``fp8_backward="fp8"`` is Transformer Engine's,
  torchao's ``Float8Linear``'s and autoprec's ``torch`` backend's recipe — dY quantised to
  the gradient format (e5m2 for fp8: amax, scale, cast), dgrad e5m2 x e4m3 and wgrad
  e5m2 x e4m3 at the format's peak, and a transposed 1-byte copy of the saved input for
  wgrad; ``fp8_backward="fp32"`` is the ``emulated`` backend (``lower.fp8._Fp8LinearFn``):
  dY quantised to e5m2, then dY, the weight and the input dequantised to fp32 and both
  gradient GEMMs run in fp32, the input's gradient cast back to its dtype;
- fused attention (SDPA): one kernel, 2.5x the forward's FLOPs (flash attention's backward
  recomputes QK^T and runs four more matmuls: five against the forward's two);
- the backward of every cast is a cast back (its ``GradKernel.cast``: the value, from its
  destination dtype to its source; autocast's input casts, weights included: a
  16-bit weight copy's gradient is cast to the fp32 master's dtype), of the model's own
  explicit casts too;
- every other op that needs a gradient (norms, activations, softmax, residual adds): one
  memory-bound kernel reading dY and what the op saved (``saves``), writing the gradients
  of its inputs; an input of another dtype than the op computed in (type promotion: a bf16
  residual added to an fp32 one) gets its gradient cast to its dtype (autograd's
  ``validate_outputs``); a value used by n differentiable ops accumulates n-1 gradient adds;
- an embedding: a scatter of dY into a gradient table the size of the weight (wgrad).

The loss (model.py's ``loss``) is outside the recorded forward and is not derived here.
What requires a gradient: trainable parameters (``Value.trainable``) and what is computed
from them; the model's inputs do not (the first GEMM has no dgrad).

``saved_activations`` (``autoprec.cost.train_memory``) reads the same ``SAVES`` table.
The step's price (``autoprec.cost.step``) prices these kernels on the target profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoprec.plan.compile import CODE
from autoprec.plan.dtype_codes import FP32, IS_FMT, OTHER, WIDTH, fixed_code
from autoprec.plan.schedule_types import Schedule
from autoprec.trace.ops import Op, OpTrace

#: How a GEMM-format leaf runs its backward: "fp8" (TE, torchao Float8Linear, autoprec's
#: torch backend: the gradient GEMMs in the format) or "fp32" (the emulated backend:
#: dequantised fp32 GEMMs).
FP8_BACKWARDS = ("fp8", "fp32")
#: Flash attention's backward FLOPs over its forward's (five matmuls against two).
ATTENTION_BACKWARD = 2.5

#: Ops whose backward reads their output (not their input): y = tanh(x) -> dx = dy (1 - y^2).
_SAVES_OUTPUT = frozenset({"tanh", "sigmoid", "exp", "relu", "_softmax", "softmax",
                           "_log_softmax", "log_softmax", "rsqrt", "sqrt", "threshold"})
#: Ops whose backward needs neither input nor output (shape only).
_SAVES_NOTHING = frozenset({"add", "sub", "neg", "cat", "sum", "mean", "clone", "copy",
                            "copy_", "_to_copy", "stack", "constant_pad_nd", "fill",
                            "zero", "expand", "repeat", "contiguous", "alias", "t"})
_NORMS = frozenset({"native_layer_norm", "native_group_norm", "native_batch_norm",
                    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"})


def saves(op: Op, trace: OpTrace, floating: np.ndarray, needs: np.ndarray
          ) -> tuple[list[int], list[int]]:
    """(input positions, output positions) of the tensors ``op``'s autograd node saves for
    its backward (derivatives.yaml's formulas), given which values are floating and which
    need a gradient."""
    ins = list(op.inputs)
    flo = [k for k, v in enumerate(ins) if floating[v]]
    name = op.name
    if op.kind in ("gemm",):
        mats = sorted(matrices(op, trace, floating))
        # each operand is saved for the other's gradient
        return [k for k in mats if any(needs[ins[j]] for j in mats if j != k)], []
    if op.kind == "attention":
        return flo[:3], [0]  # q, k, v and the output (+ its logsumexp, 1/head_dim of q)
    if op.kind == "embedding":
        return [k for k, v in enumerate(ins) if not floating[v]], []  # the indices
    if name in _NORMS:
        return flo[:1], [1, 2][:max(0, len(op.outputs) - 1)]  # x, and mean / rstd
    if name in _SAVES_OUTPUT:
        return [], [0]
    if name in _SAVES_NOTHING:
        return [], []
    if name == "native_dropout":
        return [], [1]  # the mask
    if name == "mul":
        return [k for k in flo if any(needs[ins[j]] for j in flo if j != k)], []
    return flo, []  # gelu, silu, pow, div, ... read their inputs


def matrices(op: Op, trace: OpTrace, floating: np.ndarray) -> set[int]:
    """Input positions of a GEMM's floating operands of 2 or more dims (not its bias)."""
    return {k for k, v in enumerate(op.inputs) if floating[v] and trace.values[v].ndim >= 2}


@dataclass
class GradKernel:
    """One kernel of the backward, for T plans.

    Its bytes are ``sum(numel(value) * width)`` over ``terms`` (the activation values scale
    with the batch as the forward's do); a GEMM computes ``flops`` (at the recorded batch)
    in precision ``compute``; a quantise pass of a GEMM format (``quant``: value, its width
    before, the format's precision code) is priced by the format's own passes.
    """

    part: str  # dgrad | wgrad | casts | fp8_scaling | other
    what: str  # gemm, attention, reduce, cast, quantise, transpose, dequantise, pointwise, ...
    op: int  # forward op index (-1: an inserted cast)
    on: np.ndarray  # (T,) bool: the plan runs it
    terms: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (value, width (T,))
    flops: float = 0.0
    compute: np.ndarray | None = None  # (T,) precision code of a GEMM / attention
    quant: tuple[int, np.ndarray, np.ndarray] | None = None
    #: a cast: (value, source dtype codes (T,), destination dtype codes (T,))
    cast: tuple[int, np.ndarray, np.ndarray] | None = None


@dataclass
class Backward:
    """The backward of T plans: its kernels, and which values need a gradient."""

    kernels: list[GradKernel]
    needs_grad: np.ndarray  # (values,) bool
    plans: int

    def gemms(self, row: int = 0) -> list[GradKernel]:
        """The gradient GEMMs (dgrad, wgrad; attention's backward too) plan ``row`` runs."""
        return [k for k in self.kernels if k.compute is not None and k.on[row]]


def _codes(codes: np.ndarray, t: int) -> np.ndarray:
    """(T,) dtype codes (a gradient's dtype: the value's, per plan)."""
    return np.broadcast_to(np.asarray(codes, dtype=np.int64), (t,)).copy()


def needs_grad(trace: OpTrace) -> np.ndarray:
    """(values,) bool: the value's gradient is computed by ``loss.backward()`` — trainable
    parameters and every floating value computed from one (not the model's inputs, not
    factories, not ``detach``)."""
    vals = trace.values
    floating = np.array([fixed_code(v.dtype) != OTHER for v in vals], dtype=bool)
    out = np.array([v.source == "param" and v.trainable and f for v, f in zip(vals, floating,
                                                                             strict=True)])
    for op in trace.ops:
        if op.kind == "factory" or op.name == "detach":
            continue
        if any(out[i] for i in op.inputs):
            for o in op.outputs:
                out[o] = floating[o]
    return out


def backward(sch: Schedule, fp8_backward: str = "fp8") -> Backward:
    """The gradient kernels of the training step of every plan of ``sch`` (the module
    docstring says which)."""
    if fp8_backward not in FP8_BACKWARDS:
        raise ValueError(f"fp8_backward must be one of {FP8_BACKWARDS}, got {fp8_backward!r}")
    return _Derive(sch, fp8_backward).run()


class _Derive:
    """One walk over the forward's ops, emitting each op's gradient kernels."""

    def __init__(self, sch: Schedule, fp8_backward: str) -> None:
        self.sch = sch
        self.tr = tr = sch.trace
        self.t = sch.plans
        self.style = fp8_backward
        vals = tr.values
        self.floating = np.array([fixed_code(v.dtype) != OTHER for v in vals], dtype=bool)
        self.needs = needs_grad(tr)
        self.out: list[GradKernel] = []
        self.quant = {f.op: f for f in sch.quant_inputs}
        # the dtype every value is produced in, per plan (for gradient accumulation)
        self.made = np.array([[fixed_code(v.dtype)] * self.t for v in vals],
                             dtype=np.int8).reshape(len(vals), self.t)

    def w(self, codes: np.ndarray) -> np.ndarray:
        """Bytes per element of dtype codes (a gradient is floating: OTHER never occurs)."""
        return WIDTH[np.asarray(codes, dtype=np.int64)].astype(float)

    def emit(self, part: str, what: str, op: int, on: np.ndarray, terms, **kw) -> None:  # noqa: ANN001
        on = np.broadcast_to(np.asarray(on, dtype=bool), (self.t,)).copy()
        if on.any():
            self.out.append(GradKernel(part, what, op, on, terms, **kw))

    def run(self) -> Backward:
        tr, sch = self.tr, self.sch
        uses = np.zeros(len(tr.values), dtype=np.int64)
        for i, op in enumerate(tr.ops):
            for j, o in enumerate(op.outputs):
                self.made[o] = sch.writes[i][j]
            diff = any(self.needs[o] for o in op.outputs)
            if not diff:
                continue
            for v in set(op.inputs):
                uses[v] += bool(self.needs[v])
            kern = np.broadcast_to(np.asarray(sch.kernel[i], dtype=bool), (self.t,))
            if op.kind == "view":
                continue
            if op.kind == "gemm":
                self.gemm(i, op)
            elif op.kind == "attention":
                self.attention(i, op)
            elif op.kind == "embedding":
                self.embedding(i, op)
            elif op.kind == "cast":
                src, dst = sch.reads[i][0], sch.writes[i][0]
                self.emit("casts", "cast", i, kern, [(op.outputs[0], self.w(dst)),
                                                     (op.inputs[0], self.w(src))],
                          cast=(op.inputs[0], _codes(dst, self.t), _codes(src, self.t)))
            elif op.kind != "factory":
                self.pointwise(i, op, kern)
        for c in sch.casts:  # the backward of a cast is a cast back
            if self.needs[c.value]:
                self.emit("casts", "cast", -1, c.on, [(c.value, self.w(c.dst)),
                                                      (c.value, self.w(c.src))],
                          cast=(c.value, _codes(c.dst, self.t), _codes(c.src, self.t)))
        for v in np.flatnonzero(uses > 1):  # dX = dX_1 + dX_2 + ...: n-1 adds
            wv = self.w(self.made[v])
            for _ in range(int(uses[v]) - 1):
                self.emit("other", "accumulate", -1, True, [(int(v), 3 * wv)])
        return Backward(self.out, self.needs, self.t)

    # -- per op ----------------------------------------------------------------------------------
    def gemm(self, i: int, op: Op) -> None:
        sch, t = self.sch, self.t
        ins, vals = list(op.inputs), self.tr.values
        comp = sch.compute[i] if sch.compute[i] is not None else np.full(t, CODE["fp32"])
        comp = np.asarray(comp)
        fmt = IS_FMT[comp]
        fp32 = np.full(t, CODE["fp32"], dtype=np.int8)
        base = np.where(comp == CODE["tf32"], fp32, comp)  # tf32 only inside the forward
        deq = fmt & (self.style == "fp32")
        bwd = np.where(deq, fp32, base).astype(np.int8)
        reads, out = sch.reads[i], op.outputs[0]
        dy_w = np.where(fmt & ~deq, 1.0, np.where(deq, 4.0, self.w(sch.writes[i][0])))
        mats = sorted(matrices(op, self.tr, self.floating))
        for k in mats:
            v = ins[k]
            if not self.needs[v]:
                continue
            others = [(ins[j], np.where(deq, 4.0, self.w(reads[j]))) for j in mats if j != k]
            gw = np.where(deq, 4.0, np.where(fmt, self.w(sch.writes[i][0]), self.w(reads[k])))
            part = "wgrad" if vals[v].source == "param" else "dgrad"
            self.emit(part, "gemm", i, True, [(out, dy_w), *others, (v, gw)],
                      flops=op.flops, compute=bwd)
            if part == "dgrad" and deq.any() and i in self.quant:  # grad_x.to(in_dtype)
                src = self.quant[i].src
                self.emit("casts", "cast", i, deq & (src != FP32),
                          [(v, np.full(t, 4.0)), (v, self.w(src))])
        for k, v in enumerate(ins):  # a bias: dY summed over the tokens
            if self.floating[v] and k not in mats and self.needs[v]:
                self.emit("wgrad", "reduce", i, True, [(out, self.w(sch.writes[i][0])),
                                                       (v, self.w(reads[k]))])
        if fmt.any() and any(self.needs[ins[k]] for k in mats):
            dy_src = self.w(sch.writes[i][0])
            self.emit("fp8_scaling", "quantise", i, fmt, [], quant=(out, dy_src, comp))
            if deq.any():  # dY, W and X dequantised to fp32 for the fp32 GEMMs
                for v in (out, *(ins[k] for k in mats)):
                    self.emit("fp8_scaling", "dequantise", i, deq,
                              [(v, np.ones(t)), (v, np.full(t, 4.0))])
            wgt = [ins[k] for k in mats if vals[ins[k]].source == "param" and self.needs[ins[k]]]
            acts = [ins[k] for k in mats if vals[ins[k]].source != "param"]
            if wgt and acts:  # wgrad reads X^T quantised: one transposing pass of the copy
                self.emit("fp8_scaling", "transpose", i, fmt & ~deq,
                          [(acts[0], np.ones(t)), (acts[0], np.ones(t))])

    def attention(self, i: int, op: Op) -> None:
        sch, t = self.sch, self.t
        reads = sch.reads[i]
        comp = np.asarray(sch.compute[i]) if sch.compute[i] is not None else np.full(
            t, CODE["fp32"])
        comp = np.where(comp == CODE["tf32"], CODE["fp32"], comp).astype(np.int8)
        flo = [k for k, v in enumerate(op.inputs) if self.floating[v]]
        wy = self.w(sch.writes[i][0])
        terms = [(op.inputs[k], self.w(reads[k])) for k in flo]
        terms += [(op.outputs[0], 2 * wy)]  # O and dO
        terms += [(op.inputs[k], self.w(reads[k])) for k in flo[:3] if self.needs[op.inputs[k]]]
        self.emit("dgrad", "attention", i, True, terms, flops=ATTENTION_BACKWARD * op.flops,
                  compute=comp)

    def embedding(self, i: int, op: Op) -> None:
        vals = self.tr.values
        table = [v for v in op.inputs if self.floating[v] and self.needs[v]]
        if not table:
            return
        wy = self.w(self.sch.writes[i][0])
        # embedding_dense_backward: a zeroed table the weight's size, dY scattered into it
        self.emit("wgrad", "embedding", i, True, [(op.outputs[0], wy),
                                                  (table[0], np.full(self.t, 2.0 * vals[
                                                      table[0]].itemsize))])

    def pointwise(self, i: int, op: Op, kern: np.ndarray) -> None:
        sch = self.sch
        reads, writes = sch.reads[i], sch.writes[i]
        sin, sout = saves(op, self.tr, self.floating, self.needs)
        terms = [(op.outputs[0], self.w(writes[0]))] if self.floating[op.outputs[0]] else []
        terms += [(op.inputs[k], self.w(reads[k])) for k in sin]
        terms += [(op.outputs[j], self.w(writes[j])) for j in sout if j < len(op.outputs)
                  and self.floating[op.outputs[j]]]
        terms += [(v, self.w(reads[k])) for k, v in enumerate(op.inputs)
                  if self.floating[v] and self.needs[v]]
        self.emit("other", "pointwise", i, kern, terms)
        if not self.floating[op.outputs[0]]:
            return
        for k, v in enumerate(op.inputs):  # autograd casts a gradient to its input's dtype
            if self.floating[v] and self.needs[v]:
                self.emit("casts", "cast", i, kern & (reads[k] != writes[0]),
                          [(v, self.w(writes[0])), (v, self.w(reads[k]))],
                          cast=(v, _codes(writes[0], self.t), _codes(reads[k], self.t)))


__all__ = ["ATTENTION_BACKWARD", "Backward", "FP8_BACKWARDS", "GradKernel", "backward",
           "matrices", "needs_grad", "saves"]

