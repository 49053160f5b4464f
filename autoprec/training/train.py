"""Training under a policy: fp32 master weights, a GradScaler only when fp16 is present.

The pattern for a plain PyTorch loop (HF ``Trainer``: see ``autoprec.integrations.hf``)::

    setup = prepare_training(model, policy)          # applies the policy; fp32 masters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in loader:
        step = train_step(setup, opt, batch, loss)   # loss(outputs, batch) -> Tensor
    setup.remove()                                   # or: with prepare_training(...) as setup

What it does, and why:

- No global ``torch.autocast``: the policy's per-layer regions decide each layer's compute
  dtype. Autocast casts the fp32 weights per call, so parameters, their ``.grad`` and the
  optimizer state stay fp32 ("master weights"); a model whose parameters are already 16-bit
  is refused, since its updates would be rounded to 16 bits and lost.
- A ``torch.amp.GradScaler`` is created iff some layer computes in fp16 (pytorch#127176):
  fp16's smallest subnormal is 2**-24 ≈ 6e-8, and gradients below it flush to zero in the
  fp16 backward GEMMs; multiplying the loss by the scale (65536 at start) lifts them into
  range, and the scaler unscales before the optimizer step and skips a step whose
  gradients overflowed (halving the scale). bf16 has fp32's exponent range, fp8 uses
  per-tensor scaling of its own: neither needs one.
- ``fidelity_check`` trains the same initial weights on the same batches in fp32 and
  under the policy and flags divergence by a stated rule (``FidelityReport.rule``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import ApplyOptions, PolicyHandle, apply_policy
from autoprec.errors import CapabilityError, InputError
from autoprec.formats.gemm import is_forward_only
from autoprec.plan import compile_plan
from autoprec.policy import Policy, load_policy
from autoprec.training.loss_scaler import CountingGradScaler
from autoprec.workload.loading import ModelSpec, default_forward
from autoprec.workload.metrics import mean_metric

Batch = Any
LossFn = Callable[[Any, Batch], torch.Tensor]
ForwardFn = Callable[[torch.nn.Module, Batch], Any]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


# -- setup ------------------------------------------------------------------------------


def check_fp32_masters(model: torch.nn.Module, where: str = "model") -> None:
    """Raise InputError naming the first floating parameter that is not fp32.

    Mixed precision keeps fp32 master weights and lowers per call; a 16-bit parameter
    would round every update to 16 bits (small updates vanish: 1 + 1e-4 == 1 in fp16).
    """
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            dt = str(p.dtype).replace("torch.", "")
            raise InputError(
                f"{where}: parameter {name!r} is {dt}; training under a policy needs fp32 "
                "master weights (the policy lowers compute per call, never the stored "
                "weights): call model.float() before prepare_training")


def needs_grad_scaler(handle_or_policy: PolicyHandle | Policy,
                      model: torch.nn.Module | None = None) -> bool:
    """True iff some module computes in fp16 under the policy (then loss scaling is needed)."""
    if isinstance(handle_or_policy, PolicyHandle):
        return "fp16" in handle_or_policy.plan.used()
    if model is None:
        return "fp16" in handle_or_policy.precisions
    return "fp16" in compile_plan(handle_or_policy, model).used()


@dataclass
class StepResult:
    """One optimizer step: the loss before the update, and what the scaler did."""

    loss: float
    skipped: bool  # the scaler found inf/nan gradients and skipped the update
    scale: float | None  # the loss scale after the step (None: no scaler)
    grad_norm: float | None = None  # before clipping, when max_grad_norm was given


@dataclass
class TrainingSetup:
    """A model with a policy installed for training, and its GradScaler (or None).

    Keeps the counts a training report needs: optimizer steps taken and steps the scaler
    skipped. With a scaler they are the scaler's own (``loss_scaler.CountingGradScaler``),
    so they hold however the loop drives it: ``train_step``, an ``accelerate`` loop
    (``integrations.accel.use_accelerator``) or one of the user's own.
    """

    model: torch.nn.Module
    policy: Policy
    handle: PolicyHandle
    scaler: CountingGradScaler | None
    plain_steps: int = 0  # train_step's steps without a scaler

    @property
    def steps(self) -> int:
        """Optimizer steps taken (with a scaler: each ``scaler.update()``)."""
        return self.plain_steps if self.scaler is None else self.scaler.steps

    @property
    def skipped_steps(self) -> int:
        """Steps the GradScaler skipped (inf/nan gradients); 0 without one."""
        return 0 if self.scaler is None else self.scaler.skipped_steps

    @property
    def scale(self) -> float | None:
        """The current loss scale (None without a scaler)."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def report(self) -> dict[str, Any]:
        """What ran: steps, skipped steps, loss scale, each GEMM format's backend, the fp8
        backend and why."""
        return {"steps": self.steps, "skipped_steps": self.skipped_steps,
                "loss_scale": self.scale, "format_backends": dict(self.handle.format_backends),
                "fp8_backend": self.handle.fp8_backend,
                "fp8_reason": self.handle.fp8_reason if self.handle.fp8_backend else None}

    def remove(self) -> None:
        """Uninstall the policy (the model's forwards are restored exactly)."""
        self.handle.remove()

    def __enter__(self) -> TrainingSetup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def prepare_training(
    model: torch.nn.Module,
    policy: Policy | str | Path,
    *,
    fp8_backend: str | None = None,
    device: str | torch.device | None = None,
    force: bool = False,
    scaler: bool | None = None,
    init_scale: float = 2.0**16,
) -> TrainingSetup:
    """Apply ``policy`` to ``model`` for training and create a GradScaler iff it has fp16.

    Args:
        policy: a Policy or the path of a policy file (validated against ``model``).
        fp8_backend: as ``apply_policy``'s: the fp8 layers' backend (mxfp8 / nvfp4 layers
            run the block-scaled kernels where they can, else emulation; nvfp4 trains with
            NVIDIA's recipe: 16x16 weight blocks, stochastic rounding of the gradients, a
            random Hadamard transform on the wgrad operands).
        scaler: ``None`` (default): a scaler iff some layer computes in fp16. ``False``
            turns loss scaling off (to measure what it prevents); ``True`` forces one.
        init_scale: the scaler's initial scale (torch's default, 2**16).

    Raises InputError naming the parameter when the model's parameters are not fp32,
    CapabilityError when a layer runs a forward-only GEMM format (none today: nvfp4 trains
    with NVIDIA's recipe, ``lower.nvfp4_train``), and whatever
    ``apply_policy`` raises (PolicyError, CapabilityError) with the model untouched.
    """
    check_fp32_masters(model)
    if not isinstance(policy, Policy):
        policy = load_policy(policy, model, force=force)
    if any(map(is_forward_only, policy.precisions)):  # else no need to resolve here
        plan = compile_plan(policy, model)
        res = plan.resolution()
        fwd_only = [p for p in plan.format_leaves if is_forward_only(res[p].precision)]
        if fwd_only:
            more = f" and {len(fwd_only) - 1} more" if len(fwd_only) > 1 else ""
            raise CapabilityError(f"{policy.source}: layer {fwd_only[0]!r}{more} runs "
                                  f"{res[fwd_only[0]].precision}, which autoprec runs "
                                  "forward-only (no gradient recipe): train those layers in "
                                  "a format with one or a 16-bit precision")
    # Training runs the train form whatever the policy's form (fp32 masters, gradients): a
    # deploy-form policy names the same precisions, stored once for inference.
    handle = apply_policy(model, policy, fp8_backend=fp8_backend, force=force, form="train",
                          options=ApplyOptions(device=device))
    want = needs_grad_scaler(handle) if scaler is None else scaler
    gs = CountingGradScaler(handle.device.type, init_scale=init_scale) if want else None
    return TrainingSetup(model=model, policy=policy, handle=handle, scaler=gs)


def train_step(
    setup: TrainingSetup,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: LossFn,
    forward: ForwardFn | None = None,
    max_grad_norm: float | None = None,
) -> StepResult:
    """One step: forward (policy regions, no global autocast), scaled backward, step.

    ``loss_fn(outputs, batch)`` is model.py's ``loss`` contract; ``forward(model, batch)``
    defaults to ``model(batch)`` / ``(*batch)`` / ``(**batch)``. With a scaler, gradients
    are unscaled before clipping, and a step whose gradients hold inf/nan is skipped by the
    scaler (detected as the scale having been lowered by ``update()``).
    """
    loss, skipped, grad_norm = _step(setup.model, setup.scaler, optimizer, batch, loss_fn,
                                     forward or default_forward, max_grad_norm)
    if setup.scaler is None:  # a scaler counts its own steps (loss_scaler)
        setup.plain_steps += 1
    return StepResult(loss=loss, skipped=skipped, scale=setup.scale, grad_norm=grad_norm)


def _step(model: torch.nn.Module, scaler: torch.amp.GradScaler | None,
          optimizer: torch.optim.Optimizer, batch: Batch, loss_fn: LossFn, forward: ForwardFn,
          max_grad_norm: float | None) -> tuple[float, bool, float | None]:
    """(loss, skipped, grad norm before clipping) of one step; see ``train_step``."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(forward(model, batch), batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InputError(f"loss(outputs, batch) must return a scalar tensor, got "
                         f"{type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}")
    grad_norm = None
    if scaler is None:
        loss.backward()
        if max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
        optimizer.step()
        return float(loss.detach()), False, grad_norm
    scaler.scale(loss).backward()
    if max_grad_norm is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    # update() lowers the scale (backoff 0.5) exactly when step() found inf/nan gradients
    # and skipped the optimizer step; otherwise it keeps or grows it.
    return float(loss.detach()), scaler.get_scale() < before, grad_norm


# -- fidelity check ----------------------------------------------------------------------


@dataclass
class FidelityReport:
    """fp32 vs policy training from the same weights on the same batches.

    ``diverged`` follows ``rule``; ``reasons`` says which part of it fired, with values.
    """

    steps: int
    fp32_losses: list[float]
    policy_losses: list[float]
    window: int  # final steps whose mean loss is compared
    loss_gap: float  # mean(policy) - mean(fp32) over the window
    tolerance: float  # largest allowed loss_gap
    skipped_steps: int
    final_scale: float | None  # None: no GradScaler (the policy has no fp16)
    fp32_metric: float | None
    policy_metric: float | None
    max_drop: float
    max_skipped_frac: float
    diverged: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def metric_drop(self) -> float | None:
        if self.fp32_metric is None or self.policy_metric is None:
            return None
        return self.fp32_metric - self.policy_metric

    @property
    def rule(self) -> str:
        return (f"diverged if the policy's loss is non-finite at any step, or its mean loss "
                f"over the last {self.window} steps exceeds fp32's by more than "
                f"{self.tolerance:.4g}, or more than {self.max_skipped_frac:.0%} of the steps "
                f"were skipped by the GradScaler, or the trained model's metric is more than "
                f"{self.max_drop:g} below the fp32-trained model's")

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "diverged": self.diverged, "reasons": self.reasons,
                "rule": self.rule, "window": self.window, "loss_gap": _finite(self.loss_gap),
                "tolerance": self.tolerance, "skipped_steps": self.skipped_steps,
                "final_scale": self.final_scale, "fp32_metric": self.fp32_metric,
                "policy_metric": self.policy_metric, "metric_drop": self.metric_drop,
                "fp32_losses": [_finite(x) for x in self.fp32_losses],
                "policy_losses": [_finite(x) for x in self.policy_losses]}

    def table(self, every: int | None = None) -> str:
        """Loss curves side by side (every ``every``-th step) and the verdict."""
        every = every or max(1, self.steps // 10)
        lines = [f"{'step':>6} {'fp32 loss':>12} {'policy loss':>12} {'gap':>10}"]
        for i in range(0, self.steps, every):
            a, b = self.fp32_losses[i], self.policy_losses[i]
            lines.append(f"{i:>6} {a:>12.5f} {b:>12.5f} {b - a:>+10.5f}")
        if self.fp32_metric is not None and self.policy_metric is not None:
            lines.append(f"metric: fp32 {self.fp32_metric:.4f}, policy {self.policy_metric:.4f}"
                         f" (drop {self.metric_drop:+.4f}, allowed {self.max_drop:g})")
        scale = "no GradScaler" if self.final_scale is None else f"scale {self.final_scale:g}"
        lines.append(f"{scale}, {self.skipped_steps} skipped steps; "
                     f"{'DIVERGED: ' + '; '.join(self.reasons) if self.diverged else 'ok'}")
        return "\n".join(lines)


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _evaluate(model: torch.nn.Module, batches: Sequence[Batch], forward: ForwardFn,
              metric: Callable[[Any, Batch], float]) -> float:
    model.eval()
    with torch.no_grad():
        outs = [forward(model, b) for b in batches]
    return mean_metric(metric, outs, batches)


def _train(model: torch.nn.Module, scaler: torch.amp.GradScaler | None,
           batches: Sequence[Batch], steps: int, loss_fn: LossFn, forward: ForwardFn,
           make_opt: OptimizerFactory, seed: int,
           max_grad_norm: float | None) -> tuple[list[float], int]:
    """(loss per step, skipped steps) of ``steps`` steps over ``batches`` (cycled)."""
    torch.manual_seed(seed)  # the same dropout masks in both runs
    model.train()
    opt = make_opt(model.parameters())
    losses, skipped = [], 0
    for i in range(steps):
        loss, skip, _ = _step(model, scaler, opt, batches[i % len(batches)], loss_fn,
                              forward, max_grad_norm)
        losses.append(loss)
        skipped += int(skip)
    return losses, skipped


def fidelity_check(
    build_model: Callable[[], torch.nn.Module],
    policy: Policy | str | Path,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    steps: int = 20,
    lr: float = 1e-3,
    *,
    forward: ForwardFn | None = None,
    optimizer: OptimizerFactory | None = None,
    eval_batches: Sequence[Batch] | None = None,
    metric: Callable[[Any, Batch], float] | None = None,
    max_drop: float = 0.005,
    loss_rtol: float = 0.10,
    loss_atol: float = 0.02,
    max_skipped_frac: float = 0.5,
    max_grad_norm: float | None = None,
    seed: int = 0,
    fp8_backend: str | None = None,
    force: bool = False,
) -> FidelityReport:
    """Train ``steps`` steps in fp32 and under ``policy`` from the same initial weights.

    Both runs see ``batches`` in the same order (cycled), the same optimizer (default
    ``AdamW(lr)``) and the same RNG seed; the policy run uses ``prepare_training`` (a
    GradScaler iff the policy has fp16). The verdict follows ``FidelityReport.rule``:
    the policy diverged when its loss is non-finite at some step, its mean loss over the
    last quarter of the steps exceeds fp32's by more than ``loss_rtol * |fp32| +
    loss_atol``, the scaler skipped more than ``max_skipped_frac`` of the steps, or (with
    ``eval_batches`` and ``metric``) its trained model scores more than ``max_drop`` below
    the fp32-trained one (each evaluated as it would be deployed: fp32, resp. the policy).
    """
    if steps < 1:
        raise InputError(f"fidelity_check: steps >= 1 must hold, but got {steps}")
    batches = list(batches)
    if not batches:
        raise InputError("fidelity_check: no training batches")
    if (eval_batches is None) != (metric is None):
        raise InputError("fidelity_check: give eval_batches and metric together, or neither")
    fwd = forward or default_forward
    make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=lr))

    ref = build_model()
    check_fp32_masters(ref, "build_model()")
    low = copy.deepcopy(ref)  # the same initial weights, whatever build_model does
    fp32_losses, _ = _train(ref, None, batches, steps, loss_fn, fwd, make_opt, seed,
                            max_grad_norm)
    setup = prepare_training(low, policy, fp8_backend=fp8_backend, force=force)
    try:
        pol_losses, skipped = _train(low, setup.scaler, batches, steps, loss_fn, fwd,
                                     make_opt, seed, max_grad_norm)
        m_ref = m_pol = None
        if eval_batches is not None and metric is not None:
            m_ref = _evaluate(ref, list(eval_batches), fwd, metric)
            m_pol = _evaluate(low, list(eval_batches), fwd, metric)
    finally:
        setup.remove()

    window = max(1, steps // 4)
    mean_ref = sum(fp32_losses[-window:]) / window
    mean_pol = sum(pol_losses[-window:]) / window
    tol = loss_rtol * abs(mean_ref) + loss_atol
    gap = mean_pol - mean_ref if math.isfinite(mean_pol) else math.inf
    reasons = []
    bad = [i for i, (a, b) in enumerate(zip(fp32_losses, pol_losses))
           if not math.isfinite(b) and math.isfinite(a)]
    if bad:
        i = bad[0]
        reasons.append(f"non-finite policy loss at {len(bad)} step(s), first step {i}: "
                       f"{pol_losses[i]} (fp32: {fp32_losses[i]:.4g})")
    if math.isfinite(mean_ref) and not gap <= tol:
        reasons.append(f"mean loss over the last {window} steps: policy {mean_pol:.4g} vs "
                       f"fp32 {mean_ref:.4g}, gap {gap:.4g} > tolerance {tol:.4g}")
    if skipped > max_skipped_frac * steps:
        reasons.append(f"the GradScaler skipped {skipped} of {steps} steps "
                       f"(> {max_skipped_frac:.0%}): gradients overflow fp16 at every scale")
    if m_ref is not None and m_pol is not None and not (m_ref - m_pol) <= max_drop:
        reasons.append(f"metric after training: policy {m_pol:.4g} vs fp32 {m_ref:.4g}, "
                       f"drop {m_ref - m_pol:.4g} > {max_drop:g}")
    return FidelityReport(
        steps=steps, fp32_losses=fp32_losses, policy_losses=pol_losses, window=window,
        loss_gap=gap, tolerance=tol, skipped_steps=skipped,
        final_scale=setup.scale, fp32_metric=m_ref, policy_metric=m_pol, max_drop=max_drop,
        max_skipped_frac=max_skipped_frac, diverged=bool(reasons), reasons=reasons)


def fidelity_check_spec(spec: ModelSpec, policy: Policy | str | Path, steps: int = 20,
                        lr: float = 1e-3, **kwargs: Any) -> FidelityReport:
    """``fidelity_check`` on a model.py: its build_model, calibration batches, loss, forward,
    and (when it has a metric) its eval batches and metric. What ``tune --train-aware``
    calls on a candidate policy."""
    if spec.loss is None:
        raise InputError(f"{spec.where}: a training check needs loss(outputs, batch) in model.py")
    if spec.metric is not None:
        kwargs.setdefault("eval_batches", spec.eval_batches())
        kwargs.setdefault("metric", spec.metric)
    return fidelity_check(spec.model, policy, spec.calibration_batches(), spec.loss,
                          steps=steps, lr=lr, forward=spec.forward, **kwargs)


__all__ = ["FidelityReport", "StepResult", "TrainingSetup", "check_fp32_masters",
           "fidelity_check", "fidelity_check_spec", "needs_grad_scaler", "prepare_training",
           "train_step"]
