"""The price of a whole training step under a plan: forward + backward + optimizer step.

``StepPart`` is the part of a ``CostModel`` that prices the training form's step (``tune
--form train``, ``eval`` of a training-form policy; ``CostModel(..., step=StepPart())``,
or ``make_cost_model(..., step=True)``): a plan's time is

- the forward as the cost model's forward pricer prices it (every op, cast and quantise
  pass of the replay; eager op by op, or as ``torch.compile`` runs it: see
  ``cost.compiled`` for how the compiled step's backward is priced);
- the backward derived from that replay (``plan.backward``): each GEMM's dgrad and wgrad at
  the precision it really runs in, fused attention's backward, every cast's cast back, the
  backward of norms, activations and adds, gradient accumulation, and a GEMM format's
  gradient quantisation (``fp8_backward``: "fp8" as Transformer Engine, torchao's
  ``Float8Linear`` and autoprec's ``torch`` backend run it, "fp32" as the ``emulated``
  backend does: dequantised fp32 GEMMs);
- the loss (model.py's ``loss``, forward and backward: ``cost.loss_step``) at the dtype the
  plan gives the model's output, where it was recorded (``set_loss``);
- the optimizer step over the fp32 masters (``Optimizer``; on a GPU fused AdamW: one pass
  reading parameter, gradient, exp_avg, exp_avg_sq and writing three of them; on a CPU
  torch's default loop over the parameters, eight passes each — or, where this machine
  timed that loop over the model's parameter sizes (``optimizer_s``,
  ``autoprec.measure.measure_optimizer``: its per-op host cost and the page faults of its
  out-of-place temporaries, which no bandwidth figure has), that time);
- where a plan has an fp16 region, the GradScaler: the loss scaling, the unscale and
  inf check of every gradient (a pass over the fp32 gradients unless the optimizer is
  fused, which takes the scale itself) and the scale update.

Each backward kernel is priced like a forward one: ``max(FLOPs / peak, bytes / bandwidth)
+ launch (+ GEMM set-up)``; on a CPU target with this machine's op timings, a gradient
GEMM of an op timed here takes the forward GEMM's measured time at its precision (dgrad
and wgrad have the forward's FLOPs over the same three dimensions), fused attention's
backward ``ATTENTION_BACKWARD`` times its forward's — or, where this machine timed the
gradient kernel itself (``grad_times``, ``autoprec.measure.measure_grads``: each GEMM's dgrad and wgrad at
their own layouts, fused attention's backward), that time; a backward cast its timed
cast — and a pointwise op's backward at least its forward's (it reads dY and what the
op saved, and writes dX). ``--batch-size`` is
the training micro-batch.

``breakdown`` splits the step into ``STEP_PARTS`` (fprop / dgrad / wgrad / casts /
fp8_scaling / other / loss / optimizer / scaler) and carries the step's memory
(``cost.train_memory``); ``max_train_bytes`` makes a plan whose training memory is over it
infeasible, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from autoprec.cost.loss_step import LossKernels, output_value
from autoprec.cost.op_pricing import _FORMAT_OF_CODE, OpTable, Roofline, _precision_table
from autoprec.cost.price_types import _CAST, _FP8, _GEMM, _OTHER, Breakdown, Priced
from autoprec.cost.train_memory import (
    ADAMW_STATE_BYTES,
    TrainMemory,
    saved_activation_bytes,
    trainable_numel,
)
from autoprec.device.targets import is_cpu
from autoprec.plan.backward import ATTENTION_BACKWARD, FP8_BACKWARDS, Backward, backward
from autoprec.plan.compile import CODE, RuleSet
from autoprec.plan.dtype_codes import DTYPES, FP16
from autoprec.plan.schedule import Schedule
from autoprec.policy.schema import Policy

#: Where a training step's time goes.
STEP_PARTS = ("fprop", "dgrad", "wgrad", "casts", "fp8_scaling", "other", "loss",
              "optimizer", "scaler")
_P = {p: i for i, p in enumerate(STEP_PARTS)}
#: This machine's gradient-kernel timings (``autoprec.measure.measure_grads``): op index ->
#: {"dgrad" | "wgrad": {precision: seconds}}.
GradTimes = dict[int, dict[str, dict[str, float]]]


class StepHost(Protocol):
    """What a step part reads of the cost model that holds it (``cost.model.CostModel``)."""

    forward: Any  # the forward pricer: its ``roofline`` and ``table`` price the backward

    def row(self, policy: Any, default: str = "fp32") -> tuple[RuleSet, np.ndarray]: ...

    def schedule(self, policy: Any, default: str = "fp32") -> Schedule: ...

    def held_weight_bytes(self, region: np.ndarray, prec: np.ndarray, form: str
                          ) -> np.ndarray: ...


@dataclass(frozen=True)
class Optimizer:
    """An optimizer step's memory traffic over the fp32 masters."""

    name: str
    bytes_per_param: float  # reads + writes per trainable parameter per step
    passes: int  # multi-tensor kernels per step (each launched once per tensor chunk)
    fused: bool  # takes GradScaler's scale itself (no separate unscale pass)
    state_bytes: float = ADAMW_STATE_BYTES  # optimizer state per parameter
    #: tensors one kernel launch of a pass handles (1: a Python loop over the parameters)
    tensors_per_launch: int = 110


#: torch.optim.AdamW(fused=True): one kernel reading p, g, m, v and writing p, m, v (fp32).
ADAMW_FUSED = Optimizer("adamw_fused", 7 * 4.0, 1, True)
#: torch.optim.AdamW's foreach path (torch/optim/adamw.py ``_multi_tensor_adamw``): eight
#: passes — decay p (r/w), lerp m (r m, g; w m), scale v (r/w), addcmul v (r v, g; w v),
#: sqrt v (r v; w s), div s, add eps (r/w s each), addcdiv p (r p, m, s; w p): 20 x 4 bytes.
ADAMW_FOREACH = Optimizer("adamw_foreach", 20 * 4.0, 8, False)
#: torch.optim.AdamW on a CPU (no foreach, no fused by default): the same passes as the
#: foreach path, one op per parameter tensor each.
ADAMW_LOOP = Optimizer("adamw_loop", 20 * 4.0, 8, False, tensors_per_launch=1)
OPTIMIZERS = {o.name: o for o in (ADAMW_FUSED, ADAMW_FOREACH, ADAMW_LOOP)}


@dataclass
class StepBreakdown(Breakdown):
    """Where one plan's training step goes (``parts``: ``STEP_PARTS``), and its memory."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    memory: TrainMemory | None = None
    backward_casts: int = 0
    step_parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out.update({"forward_us": round(self.forward_s * 1e6, 3),
                    "backward_us": round(self.backward_s * 1e6, 3),
                    "backward_casts": self.backward_casts})
        if self.memory is not None:
            out["memory"] = self.memory.to_dict()
        return out


class StepPart:
    """The backward, optimizer step and GradScaler a ``CostModel`` adds to its forward.

    ``StepPart(fp8_backward=..., optimizer=...)`` says how the step runs; the cost model
    it is handed to binds it to its graph (``bound``: the trainable parameters, and the
    optimizer a trainer runs by default on the device). ``price`` and ``breakdown`` take
    the forward's (priced by the cost model's forward pricer) and return the step's; a
    deploy-form policy cannot train (inf, with the reason). ``max_train_bytes``: a plan
    whose training step holds more bytes cannot run (``--memory-limit``).
    """

    def __init__(self, fp8_backward: str = "fp8", optimizer: Optimizer | None = None,
                 grad_times: GradTimes | None = None, optimizer_s: float | None = None
                 ) -> None:
        if fp8_backward not in FP8_BACKWARDS:
            raise ValueError(f"fp8_backward must be one of {FP8_BACKWARDS}, got {fp8_backward!r}")
        self.fp8_backward = fp8_backward
        self.optimizer = optimizer
        #: this machine's dgrad / wgrad (and attention backward) timings per op and precision
        self.grad_times = grad_times
        #: this machine's time of torch's default AdamW step over the model's trainable
        #: parameters (``autoprec.measure.measure_optimizer``): the price of ``ADAMW_LOOP``
        self.optimizer_s = optimizer_s
        self.max_train_bytes: float | None = None
        self._n_params = 0.0
        self._n_tensors = 0
        #: the loss's seconds by the output's dtype code (None: the loss is not priced)
        self._loss_s: np.ndarray | None = None
        self._loss_value: int | None = None
        self._loss_saved: dict[int, float] = {}  # what it saves, by the output's dtype code

    def bound(self, graph: Any, device_type: str) -> StepPart:
        """This step part for ``graph``'s trainable parameters on ``device_type``."""
        new = StepPart(self.fp8_backward, self.optimizer, self.grad_times, self.optimizer_s)
        new._loss_s, new._loss_value = self._loss_s, self._loss_value
        new._loss_saved = self._loss_saved
        # what torch.optim.AdamW runs by default: fused / foreach on a GPU (a trainer's
        # choice: fused), a loop over the parameters on a CPU
        new.optimizer = self.optimizer or (ADAMW_LOOP if is_cpu(device_type) else ADAMW_FUSED)
        new.max_train_bytes = self.max_train_bytes
        new._n_params = trainable_numel(graph.ops) if graph.ops is not None else 0.0
        new._n_tensors = (sum(1 for v in graph.ops.values if v.source == "param"
                              and v.trainable and v.param) if graph.ops is not None else 0)
        return new

    @property
    def _opt(self) -> Optimizer:
        if self.optimizer is None:
            raise ValueError("a StepPart prices only once a CostModel has bound it")
        return self.optimizer

    def set_loss(self, cost: Any, kernels: LossKernels) -> None:
        """Price the loss of every step of ``cost`` (the ``CostModel`` holding this part):
        ``cost.loss_step.record_loss``'s kernels and, on a local CPU, its timings, scaled
        from the recorded batch to the priced one."""
        r = cost.forward.roofline
        v = output_value(r.trace, kernels.numel)
        if v is None:
            raise ValueError(f"no output of {kernels.numel} elements in the recorded forward")
        scale = r.scale if r.trace.values[v].scales else 1.0
        self._loss_s = kernels.table(r.bw, r.launch, scale)
        self._loss_value = v
        self._loss_saved = {DTYPES.index(d): b * scale for d, b in kernels.saved.items()}
        cost._fp32, cost._given = cost._reference_times()  # the references pay it too

    def _output_code(self, sch: Schedule) -> np.ndarray:
        """(T,) dtype code the model's output arrives in at the loss (fp32 unless an op of
        the replay wrote it otherwise)."""
        code = np.zeros(sch.plans, dtype=np.int64)
        for i, op in enumerate(sch.trace.ops):
            if self._loss_value in op.outputs:
                code = np.broadcast_to(np.asarray(
                    sch.writes[i][op.outputs.index(self._loss_value)], dtype=np.int64),
                    (sch.plans,))
        return code

    def _loss_saved_bytes(self, sch: Schedule) -> np.ndarray:
        """(T,) bytes the loss saves for its backward."""
        if not self._loss_saved:
            return np.zeros(sch.plans)
        return np.array([self._loss_saved.get(int(c), max(self._loss_saved.values()))
                         for c in self._output_code(sch)])

    def _loss_seconds(self, sch: Schedule) -> np.ndarray:
        """(T,) seconds of the loss under each plan (0 where it is not priced)."""
        if self._loss_s is None or self._loss_value is None:
            return np.zeros(sch.plans)
        sec = self._loss_s[np.minimum(self._output_code(sch), len(self._loss_s) - 1)]
        return np.where(np.isnan(sec), np.nanmax(self._loss_s), sec)

    # -- pricing ----------------------------------------------------------------------------------
    def price(self, cost: StepHost, fwd: Priced, rules: RuleSet, codes: np.ndarray,
              form: str) -> Priced:
        """The step's price of T plans from their forward's (``fwd``)."""
        if form != "train":  # stored 16-bit weights: the step's updates are lost
            why = "--form train: it stores no fp32 masters"  # as tuning.confirm.tune_baseline_rows says it
            return Priced(np.full_like(fwd.time, math.inf), fwd.parts, fwd.schedule,
                          {**{r: why for r in range(len(fwd.time))}, **fwd.reasons})
        sch = fwd.schedule
        bwd = backward(sch, self.fp8_backward)
        step = self._step_parts(cost, sch, fwd.parts, bwd)
        reasons = dict(fwd.reasons)
        bad = ~np.isfinite(fwd.time)
        if self.max_train_bytes is not None:
            mem = self.memory_of(cost, sch, bwd, rules, codes)
            over = mem > self.max_train_bytes
            for row in np.flatnonzero(over & ~bad):
                reasons.setdefault(int(row), f"training memory {mem[row] / 1e9:.2f} GB > "
                                             f"--memory-limit {self.max_train_bytes / 1e9:g} GB")
            bad = bad | over
        time = np.where(bad, math.inf, step.sum(axis=1))
        out = Priced(time, fwd.parts, sch, reasons)
        out.step = step  # type: ignore[attr-defined]
        return out

    def _step_parts(self, cost: StepHost, sch: Schedule, fwd: np.ndarray, bwd: Backward
                    ) -> np.ndarray:
        """(T, len(STEP_PARTS)) seconds."""
        r, tab = cost.forward.roofline, cost.forward.table
        t = sch.plans
        out = np.zeros((t, len(STEP_PARTS)))
        out[:, _P["fprop"]] = fwd[:, _GEMM]
        out[:, _P["casts"]] = fwd[:, _CAST]
        out[:, _P["fp8_scaling"]] = fwd[:, _FP8]
        out[:, _P["other"]] = fwd[:, _OTHER]
        for k, sec in self._kernel_seconds(r, tab, sch, bwd):
            out[:, _P[k.part]] += np.where(k.on, sec, 0.0)
        out[:, _P["loss"]] = self._loss_seconds(sch)
        out[:, _P["optimizer"]] = self._optimizer_s(r)
        fp16 = np.zeros(t, dtype=bool)
        for codes in sch.compute:
            if codes is not None:
                fp16 |= np.asarray(codes) == CODE["fp16"]
        for w in sch.writes:
            fp16 |= (w == FP16).any(axis=0)  # an fp16 region ran
        out[:, _P["scaler"]] = np.where(fp16, self._scaler_s(r), 0.0)
        return out

    def _kernel_seconds(self, r: Roofline, tab: OpTable, sch: Schedule, bwd: Backward
                        ) -> Iterator[tuple[Any, np.ndarray]]:
        """(kernel, (T,) seconds) of every backward kernel."""
        bw, launch = r.bw, r.launch
        for k in bwd.kernels:
            nbytes = sum((r.numel[v] * w for v, w in k.terms), np.zeros(sch.plans))
            if k.quant is not None:
                v, src_w, fmt_codes = k.quant
                sec = np.zeros(sch.plans)
                for code, fmt in _FORMAT_OF_CODE.items():
                    on = fmt_codes == code
                    if on.any():
                        sec = np.where(on, fmt.quant_seconds(r.numel[v], src_w, bw, launch),
                                       sec)
                yield k, sec
                continue
            if k.compute is None:
                sec = nbytes / bw + launch
                if k.cast is not None and tab.op_times is not None:  # timed here
                    sec = _timed_cast(tab, k.cast, sec)
                if k.what == "pointwise" and k.op >= 0 and tab.timed[k.op] is not None:
                    # reading dY and what it saved, writing dX: at least its forward's time
                    fwd_s = tab.op_seconds(k.op, sch, None)
                    sec = np.where(np.isnan(fwd_s), sec, np.maximum(sec, fwd_s))
                yield k, sec
                continue
            fwd_flops = r.trace.ops[k.op].flops
            scale = r.op_flops[k.op] / fwd_flops if fwd_flops else 1.0
            peak = r.peak[k.compute]
            with np.errstate(divide="ignore", invalid="ignore"):
                ct = np.where(peak > 0, k.flops * scale / np.where(peak > 0, peak, 1.0),
                              math.inf)
            sec = np.maximum(ct, nbytes / bw) + launch + r.setup[k.compute]
            timed = tab.timed[k.op]
            if timed is not None:  # this machine's time of the forward op, per precision
                got = timed[k.compute] * (ATTENTION_BACKWARD if k.what == "attention" else 1.0)
                sec = np.where(np.isnan(got), sec, got)
            grads = (self.grad_times or {}).get(k.op, {}).get(k.part)
            if grads and k.what in ("gemm", "attention"):  # the gradient kernel, timed here
                got = _precision_table(grads)[k.compute]
                sec = np.where(np.isnan(got), sec, got)
            yield k, sec

    def _optimizer_s(self, r: Roofline) -> float:
        o = self._opt
        if o is ADAMW_LOOP and self.optimizer_s is not None:  # timed here, as it runs
            return self.optimizer_s
        launches = o.passes * max(1, math.ceil(self._n_tensors / o.tensors_per_launch))
        return o.bytes_per_param * self._n_params / r.bw + launches * r.launch

    def _scaler_s(self, r: Roofline) -> float:
        """GradScaler: loss * scale, the unscale + inf check (one read and write of every
        fp32 gradient, unless the fused optimizer takes the scale), the scale update."""
        unscale = 0.0 if self._opt.fused else 8.0 * self._n_params / r.bw
        launches = 2 + (0 if self._opt.fused else
                        max(1, math.ceil(self._n_tensors / self._opt.tensors_per_launch)))
        return unscale + launches * r.launch

    # -- memory -----------------------------------------------------------------------------------
    def memory_of(self, cost: StepHost, sch: Schedule, bwd: Backward, rules: RuleSet,
                  codes: np.ndarray) -> np.ndarray:
        """(T,) training-memory peak (``TrainMemory.peak_bytes``) of the plans."""
        region, prec, _ = rules.encode(codes)
        weights = cost.held_weight_bytes(region, prec, "train")
        acts = (saved_activation_bytes(sch, bwd, cost.forward.roofline.numel)
                + self._loss_saved_bytes(sch))
        fixed = self._n_params * (4.0 + self._opt.state_bytes)
        return weights + acts + fixed

    def train_memory(self, cost: StepHost, policy: Policy | dict[str, str],
                     default: str = "fp32") -> TrainMemory:
        """Weights, gradients, optimizer state and saved activations of one plan."""
        rs, row = cost.row(policy, default)
        region, prec, _ = rs.encode(row)
        sch = cost.schedule(policy, default)
        bwd = backward(sch, self.fp8_backward)
        return TrainMemory(float(cost.held_weight_bytes(region, prec, "train")[0]),
                           4.0 * self._n_params, self._opt.state_bytes * self._n_params,
                           float(saved_activation_bytes(sch, bwd,
                                                        cost.forward.roofline.numel)[0]
                                 + self._loss_saved_bytes(sch)[0]))

    def breakdown(self, cost: StepHost, fwd: Breakdown, policy: Policy | dict[str, str],
                  default: str = "fp32") -> Breakdown:
        """The step's breakdown of one train-form plan from its forward's (``fwd``)."""
        sch = cost.schedule(policy, default)
        bwd = backward(sch, self.fp8_backward)
        fparts = np.array([[fwd.parts[p] for p in ("gemm", "cast", "gemm_format_scaling",
                                                   "other")]])
        step = self._step_parts(cost, sch, fparts, bwd)[0]
        parts = {p: float(step[i]) for i, p in enumerate(STEP_PARTS)}
        opt = parts["optimizer"] + parts["scaler"] + parts["loss"]
        total = float(step.sum())
        return StepBreakdown(
            total if fwd.invalid is None else math.inf, parts, fwd.casts, fwd.weight_casts,
            fwd.kernels + sum(1 for k in bwd.kernels if k.on[0]), fwd.by_module,
            fwd.gemm_precision, fwd.invalid, forward_s=fwd.total_s,
            backward_s=total - fwd.total_s - opt if math.isfinite(fwd.total_s) else math.inf,
            memory=self.train_memory(cost, policy, default),
            backward_casts=sum(1 for k in bwd.kernels if k.what == "cast" and k.on[0]),
            step_parts=parts)


def _timed_cast(tab: OpTable, cast: tuple[int, np.ndarray, np.ndarray], sec: np.ndarray
                ) -> np.ndarray:
    """(T,) seconds of a backward cast: this machine's timed cast of the value's size, or,
    where only a parameter's cast of that size was timed (``measure.ops._cast_times`` times
    a weight's cast cycled through copies when the weights overflow L2, and keeps only
    that), that one — the gradient of a 16-bit weight copy cast to its fp32 master is a
    cast of the parameter's size, into a fresh tensor as the forward's is; ``sec`` where
    neither was timed."""
    for weight in (True, False):  # the value's own size's cast last: it wins
        got = tab.cast_seconds(*cast, weight)
        if got is not None:
            sec = np.where(np.isnan(got), sec, got)
    return sec


def step_metrics(bd: Breakdown) -> dict[str, float]:
    """The policy's metrics of a training step's breakdown (flat, for the YAML file and
    MLflow): the step's estimated microseconds per part and its memory; {} for a forward's."""
    if not isinstance(bd, StepBreakdown) or not math.isfinite(bd.total_s):
        return {}
    out = {"est_step_us": round(bd.total_s * 1e6, 3)}
    out.update({f"est_{k}_us": round(v * 1e6, 3) for k, v in bd.parts.items()})
    if bd.memory is not None:
        out.update({f"est_train_{k}": v for k, v in bd.memory.to_dict().items()})
    return out


def train_bytes(cost: Any, policy: Policy) -> int | None:
    """The estimated training-memory peak of ``policy`` under the ``CostModel`` ``cost``
    (None: not priced as a step)."""
    if cost.step is None or policy.form != "train":
        return None
    return int(cost.train_memory(policy).peak_bytes)


def fp8_backward_of(backend: str | None) -> str:
    """How an fp8 backend runs the backward: "fp32" for the ``emulated`` backend
    (dequantised fp32 GEMMs, ``lower.fp8._Fp8LinearFn``), "fp8" for the others — Transformer
    Engine (``te``, ``te-delayed``), torchao's Float8Linear (``torchao``, ``torchao-rowwise``),
    autoprec's ``torch`` backend (dgrad and wgrad as ``_scaled_mm``) — and for a target
    priced from its profile alone (None)."""
    return "fp32" if backend == "emulated" else "fp8"


__all__ = ["ADAMW_FOREACH", "ADAMW_FUSED", "ADAMW_LOOP", "OPTIMIZERS", "Optimizer", "STEP_PARTS",
           "StepBreakdown", "StepHost", "StepPart", "fp8_backward_of",
           "step_metrics", "train_bytes"]
