"""The short-run training check: does a plan train like fp32? A stated, tight contract.

**The contract** (docs/training.md states it for users): from one initial model
(``build_model()`` once, deep-copied per run), train ``steps`` optimizer steps on the
calibration batches (cycled, in order) with ``AdamW(lr)`` and the same seed (the same
dropout masks) — once in fp32 and once under the plan (``autoprec.training.train.prepare_training``:
fp32 master weights, a GradScaler iff a layer computes in fp16). Then the **eval loss** —
the mean of model.py's ``loss`` over ``eval_data()`` (the calibration batches when there is
none), in eval mode, the plan still applied (as the trained model is evaluated) — must be
within ``max_loss_gap`` of fp32's, relative::

    passed  ⇔  every step's loss is finite  and  the GradScaler skipped at most half the
               steps  and  (eval_loss(plan) − eval_loss(fp32)) / |eval_loss(fp32)| ≤ max_loss_gap

A lower eval loss than fp32's passes. The one-liners a trainer writes instead — one global
bf16 autocast (``TrainingArguments(bf16=True)``: the plan ``default: bf16``) and one global
fp16 autocast with a GradScaler (``fp16=True``: ``default: fp16``) — are checked by the same
function, so they are real choices.

**Cheap where the CPU is slow at 16 bits.** The runs go through ``lower/wide16``'s
``scoring_gemms``: a 16-bit GEMM this CPU has no fast kernel for (fp16 on an AVX512-BF16
EPYC, bf16 and fp16 on an AVX2-only one) is computed as tensor cores compute it — its
16-bit operands (autocast casts them, forward and backward) upcast exactly, one fp32 GEMM,
the result rounded to the 16-bit dtype — in the forward *and* the backward (the dgrad and
wgrad GEMMs are aten ``mm``/``addmm``/``bmm`` too). The numerics are the 16-bit ones; only
the summation order differs. These runs check accuracy; speed is never read from them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.errors import InputError
from autoprec.fused import fused_paths_off
from autoprec.lower.wide16 import scoring_gemms
from autoprec.policy import Policy
from autoprec.workload.loading import ModelSpec, default_forward

#: Default optimizer steps of the check (a few passes over a handful of calibration batches).
DEFAULT_STEPS = 16
#: Default relative eval-loss gap (1 %: what a trainer would accept as "trains like fp32").
DEFAULT_MAX_LOSS_GAP = 0.01
#: Default AdamW learning rate (a fine-tuning rate; HF's TrainingArguments default is 5e-5).
DEFAULT_LR = 1e-4
#: A plan whose GradScaler skipped more than this share of the steps fails.
MAX_SKIPPED_FRAC = 0.5


@dataclass
class ShortRun:
    """One short training run: its losses, its eval loss and what it cost."""

    label: str
    losses: list[float]
    eval_loss: float
    skipped: int = 0
    scaler: bool = False  # trained with a GradScaler (the plan has fp16)
    seconds: float = 0.0
    wide_gemms: int = 0  # 16-bit GEMMs computed wide (lower/wide16), forward and backward


@dataclass
class ShortRunVerdict:
    """A plan's run against fp32's, judged by the contract (``rule``)."""

    run: ShortRun
    fp32: ShortRun
    max_loss_gap: float
    steps: int
    gap: float  # relative eval-loss gap, (plan - fp32) / |fp32|
    passed: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def rule(self) -> str:
        return (f"after {self.steps} steps from one init, eval loss within "
                f"{self.max_loss_gap:.2%} of fp32's (relative), every step's loss finite, "
                f"at most {MAX_SKIPPED_FRAC:.0%} of the steps skipped by the GradScaler")

    def why_not(self) -> str:
        """'' when passed, else one line for a table cell."""
        return "" if self.passed else "short run: " + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.run.label, "steps": self.steps, "passed": self.passed,
                "eval_loss": _finite(self.run.eval_loss),
                "fp32_eval_loss": _finite(self.fp32.eval_loss),
                "gap": _finite(self.gap), "max_loss_gap": self.max_loss_gap,
                "skipped_steps": self.run.skipped, "grad_scaler": self.run.scaler,
                "seconds": round(self.run.seconds, 2), "reasons": list(self.reasons),
                "rule": self.rule}


def _finite(x: float) -> float | str:
    return round(x, 6) if math.isfinite(x) else str(x)


def eval_loss(model: torch.nn.Module, batches: Sequence[Any], forward: Callable[..., Any],
              loss_fn: Callable[[Any, Any], torch.Tensor]) -> float:
    """Mean ``loss`` over ``batches`` in eval mode without gradients (training restored)."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), fused_paths_off():
            vals = [float(loss_fn(forward(model, b), b)) for b in batches]
    finally:
        model.train(was)
    return sum(vals) / len(vals) if vals else math.nan


class ShortRunCheck:
    """The contract of the module docstring on one model: fp32's run once, each plan's
    run once (cached by its rules).

    ``build_model``: the initial model (called once); ``batches``: the training batches
    (cycled); ``eval_batches``: the eval loss's (default: ``batches``).
    """

    def __init__(self, build_model: Callable[[], torch.nn.Module], batches: Sequence[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor], *,
                 eval_batches: Sequence[Any] | None = None,
                 forward: Callable[..., Any] | None = None, steps: int = DEFAULT_STEPS,
                 lr: float = DEFAULT_LR, seed: int = 0,
                 max_loss_gap: float = DEFAULT_MAX_LOSS_GAP,
                 fp8_backend: str | None = None, emulate: bool = True) -> None:
        if steps < 1:
            raise InputError(f"--train-steps: must be >= 1, got {steps}")
        if not (math.isfinite(max_loss_gap) and max_loss_gap >= 0):
            raise InputError(f"--max-loss-gap: must be a finite number >= 0, got {max_loss_gap}")
        self.batches = list(batches)
        if not self.batches:
            raise InputError("short-run check: no training batches")
        self.eval_batches = list(eval_batches) if eval_batches is not None else self.batches
        self.build_model, self.loss_fn = build_model, loss_fn
        self.forward = forward or default_forward
        self.steps, self.lr, self.seed = steps, lr, seed
        self.max_loss_gap, self.fp8_backend, self.emulate = max_loss_gap, fp8_backend, emulate
        self._init: torch.nn.Module | None = None
        self._fp32: ShortRun | None = None
        self._cache: dict[Any, ShortRunVerdict] = {}
        self.seconds = 0.0  # every run so far, fp32's included (wall)
        self.cpu_seconds = 0.0  # ... their CPU time (this process)

    @classmethod
    def from_spec(cls, spec: ModelSpec, **kwargs: Any) -> ShortRunCheck:
        """The check on a model.py: build_model, calibration batches, eval batches, loss."""
        if spec.loss is None:
            raise InputError(f"{spec.path}: a training check needs loss(outputs, batch) in "
                             "model.py")
        return cls(spec.model, spec.calibration_batches(), spec.loss,
                   eval_batches=spec.eval_batches(), forward=spec.forward, **kwargs)

    def _fresh(self) -> torch.nn.Module:
        if self._init is None:
            from autoprec.training.train import check_fp32_masters

            self._init = self.build_model()
            check_fp32_masters(self._init, "build_model()")
        return copy.deepcopy(self._init)

    def fp32(self) -> ShortRun:
        """fp32's run (once)."""
        if self._fp32 is None:
            self._fp32 = self._run(None, "fp32")
        return self._fp32

    def check(self, policy: Policy | None, label: str = "") -> ShortRunVerdict:
        """``policy``'s run judged against fp32's (None or an all-fp32 plan: fp32 itself)."""
        fp32_plan = policy is None or (policy.default == "fp32"
                                       and set(policy.layers.values()) <= {"fp32"})
        key = None if policy is None or fp32_plan else (
            policy.default, tuple(sorted(policy.layers.items())))
        if key in self._cache:
            return self._cache[key]
        ref = self.fp32()
        run = ref if fp32_plan else self._run(policy, label or _label(policy))
        verdict = self._judge(run, ref)
        self._cache[key] = verdict
        return verdict

    def _judge(self, run: ShortRun, ref: ShortRun) -> ShortRunVerdict:
        reasons = []
        bad = [i for i, x in enumerate(run.losses) if not math.isfinite(x)]
        if bad:
            reasons.append(f"non-finite loss at {len(bad)} step(s), first step {bad[0]}")
        if run.skipped > MAX_SKIPPED_FRAC * self.steps:
            reasons.append(f"the GradScaler skipped {run.skipped} of {self.steps} steps")
        base = ref.eval_loss
        if not math.isfinite(run.eval_loss):
            gap = math.inf
        elif base == 0:
            gap = 0.0 if run.eval_loss <= 0 else math.inf
        else:
            gap = (run.eval_loss - base) / abs(base)
        if not gap <= self.max_loss_gap:
            reasons.append(f"eval loss {run.eval_loss:.5g} vs fp32 {base:.5g} after "
                           f"{self.steps} steps: {gap:+.2%} > {self.max_loss_gap:.2%}")
        return ShortRunVerdict(run, ref, self.max_loss_gap, self.steps, gap, not reasons,
                               reasons)

    def _run(self, policy: Policy | None, label: str) -> ShortRun:
        from autoprec.training.train import _train, prepare_training

        started, cpu = time.monotonic(), time.process_time()
        model = self._fresh()
        make_opt = _adamw(self.lr)
        with scoring_gemms() if self.emulate else contextlib.nullcontext() as wide:
            if policy is None:
                losses, skipped = _train(model, None, self.batches, self.steps, self.loss_fn,
                                         self.forward, make_opt, self.seed, None)
                ev, scaler = eval_loss(model, self.eval_batches, self.forward,
                                       self.loss_fn), False
            else:
                setup = prepare_training(model, policy, fp8_backend=self.fp8_backend)
                try:
                    losses, skipped = _train(model, setup.scaler, self.batches, self.steps,
                                             self.loss_fn, self.forward, make_opt, self.seed,
                                             None)
                    ev = eval_loss(model, self.eval_batches, self.forward, self.loss_fn)
                    scaler = setup.scaler is not None
                finally:
                    setup.remove()
        seconds = time.monotonic() - started
        self.seconds += seconds
        self.cpu_seconds += time.process_time() - cpu
        return ShortRun(label, losses, ev, skipped, scaler, seconds,
                        getattr(wide, "calls", 0) if wide is not None else 0)

    def known(self, policy: Policy) -> ShortRunVerdict | None:
        """``policy``'s verdict when it was checked (nothing runs)."""
        if policy.default == "fp32" and set(policy.layers.values()) <= {"fp32"}:
            if None not in self._cache and self._fp32 is not None:  # fp32's own run
                self._cache[None] = self._judge(self._fp32, self._fp32)
            return self._cache.get(None)
        return self._cache.get((policy.default, tuple(sorted(policy.layers.items()))))

    def verdicts(self) -> list[ShortRunVerdict]:
        """Every plan checked so far, in order."""
        return list(self._cache.values())


def _adamw(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=lr)


def _label(policy: Policy) -> str:
    if not policy.layers:
        return f"default: {policy.default}"
    return f"default: {policy.default} + {len(policy.layers)} rules"


__all__ = ["DEFAULT_LR", "DEFAULT_MAX_LOSS_GAP", "DEFAULT_STEPS", "MAX_SKIPPED_FRAC",
           "ShortRun", "ShortRunCheck", "ShortRunVerdict", "eval_loss"]
