"""HuggingFace ``Trainer`` under an autoprec policy: ``PolicyTrainer``.

``Trainer(fp16=True)`` does two things through accelerate (``Accelerator.__init__`` and
``prepare_model`` in accelerate 1.x): it creates a ``GradScaler`` and it wraps the model's
forward in a *global* ``torch.autocast(float16)``. A policy needs the first and must not
have the second: the global region would lower every layer the policy keeps in fp32 or
bf16 (the policy's fp32 islands upcast their inputs, but the root's default and any code
between wrappers would run under the global fp16 autocast). So ``PolicyTrainer``:

1. applies the policy to the model (``apply_policy``; weights stay fp32 masters — a model
   with 16-bit parameters is refused, naming the parameter);
2. builds accelerate with ``mixed_precision="no"`` whatever ``fp16``/``bf16`` say: no global
   autocast, the policy's per-layer regions decide (a warning says so when they were set);
3. when some layer computes in fp16, attaches a ``torch.amp.GradScaler`` to the
   accelerator before it wraps the optimizer. Accelerate then does what it does for
   ``fp16=True``: ``accelerator.backward`` scales the loss, the wrapped optimizer steps
   through ``scaler.step``/``update`` and reports a skipped step (Trainer then holds the LR
   schedule), and gradients are unscaled before clipping (``max_grad_norm``);
4. logs ``loss_scale`` and ``skipped_steps`` with the loss.

This also works on CPU, where accelerate refuses ``fp16=True`` outright. Usage::

    trainer = PolicyTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            policy="policies/bert-h100.yaml")
    trainer.train()
    trainer.remove_policy()   # the model's forwards restored

Requires ``transformers`` and ``accelerate`` (``pip install autoprec[examples]``).
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import ApplyOptions, PolicyHandle, apply_policy
from autoprec.errors import InputError
from autoprec.policy import Policy, load_policy
from autoprec.train import check_fp32_masters, needs_grad_scaler

try:
    from transformers import Trainer, TrainerCallback
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("autoprec.integrations.hf needs transformers and accelerate: "
                      "pip install 'autoprec[examples]'") from err


def _unscale_gradients(self: Any, optimizer: Any = None) -> None:
    """``Accelerator.unscale_gradients`` for a scaler accelerate did not create itself.

    Accelerate unscales only when its own ``mixed_precision == "fp16"``; ours is "no" (no
    global autocast), so clipping would see scaled gradients without this.
    """
    from accelerate.optimizer import AcceleratedOptimizer

    if self.scaler is None:
        return
    opts = self._optimizers if optimizer is None else (
        optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
    for opt in opts:
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        self.scaler.unscale_(opt)


class _ScalerStats(TrainerCallback):
    """Counts optimizer steps the GradScaler skipped (gradient overflow)."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer
        self.skipped = 0

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.accelerator.optimizer_step_was_skipped:
            self.skipped += 1


class PolicyTrainer(Trainer):
    """``transformers.Trainer`` that trains under an autoprec policy (see module docs).

    Extra keyword arguments: ``policy`` (a Policy or a policy file), ``fp8_backend`` (the
    fp8 layers' backend, as ``apply_policy``'s),
    ``force`` (apply a policy whose fingerprint does not match, with a warning).
    """

    def __init__(self, *args: Any, policy: Policy | str | Path, fp8_backend: str | None = None,
                 force: bool = False, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        if model is None:
            raise InputError("PolicyTrainer: pass model=...; model_init would build a model "
                             "the policy is not applied to")
        if kwargs.get("model_init") is not None:
            raise InputError("PolicyTrainer: model_init is not supported (the policy is "
                             "applied to the model given at construction)")
        check_fp32_masters(model)
        if not isinstance(policy, Policy):
            policy = load_policy(policy, model, force=force)
        else:
            policy.validate(model, force=force)
        # Decided before Trainer.__init__, which builds the accelerator.
        self.policy = policy
        self._needs_scaler = needs_grad_scaler(policy, model)
        self._stats: _ScalerStats | None = None
        self.policy_handle: PolicyHandle | None = None
        super().__init__(*args, **kwargs)
        self._stats = _ScalerStats(self)
        self.add_callback(self._stats)
        # After Trainer placed the model: the capability checks see its real device.
        device = next((p.device for p in self.model.parameters()), self.args.device)
        # training: the train form (fp32 masters) whatever the policy's form
        self.policy_handle = apply_policy(self.model, policy, fp8_backend=fp8_backend,
                                          force=force, form="train",
                                          options=ApplyOptions(device=device))

    # -- accelerate: no global autocast, our scaler ---------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)
        if out.get("mixed_precision", "no") != "no":
            warnings.warn(
                f"PolicyTrainer: mixed_precision={out['mixed_precision']!r} (fp16/bf16=True) "
                "is ignored: its global autocast would override the policy's per-layer "
                "precisions; the policy decides, and a GradScaler is created iff it has fp16 "
                "layers", UserWarning, stacklevel=2)
            out["mixed_precision"] = "no"
        return out

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        if self._needs_scaler:
            acc.scaler = torch.amp.GradScaler(acc.device.type)
            acc.unscale_gradients = types.MethodType(_unscale_gradients, acc)
        else:
            acc.scaler = None

    # -- reporting -------------------------------------------------------------------------
    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler (None when the policy has no fp16 layer)."""
        return self.accelerator.scaler

    @property
    def loss_scale(self) -> float | None:
        s = self.scaler
        return None if s is None else float(s.get_scale())

    @property
    def skipped_steps(self) -> int:
        return 0 if self._stats is None else self._stats.skipped

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None and "loss" in logs:
            logs = {**logs, "loss_scale": self.loss_scale or 0.0,
                    "skipped_steps": float(self.skipped_steps)}
        super().log(logs, *args, **kwargs)

    def remove_policy(self) -> None:
        """Uninstall the policy: the model's original forwards are restored."""
        if self.policy_handle is not None:
            self.policy_handle.remove()


__all__ = ["PolicyTrainer"]
