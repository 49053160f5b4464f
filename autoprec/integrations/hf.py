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
4. logs ``loss_scale`` and ``skipped_steps`` (counted by the scaler,
   ``loss_scaler.CountingGradScaler``) with the loss, and ``train()``'s metrics carry
   ``train_skipped_steps``, ``train_loss_scale`` and ``train_optimizer_steps``.

``gradient_accumulation_steps > 1`` and ``torch_compile=True`` work as in ``Trainer``: the
loss is scaled on every micro-batch, the scaler steps once per optimizer step; the compiled
model is the policy-applied one (``apply_policy`` wraps forwards ``torch.compile`` traces).

This also works on CPU, where accelerate refuses ``fp16=True`` outright. Usage::

    trainer = PolicyTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            policy="policies/bert-h100.yaml")
    trainer.train()
    trainer.remove_policy()   # the model's forwards restored

Requires ``transformers`` and ``accelerate`` (``pip install autoprec[examples]``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.apply import ApplyOptions, PolicyHandle, apply_policy
from autoprec.errors import InputError
from autoprec.integrations.accel import attach_scaler
from autoprec.policy import Policy, load_policy
from autoprec.training.loss_scaler import CountingGradScaler
from autoprec.training.train import check_fp32_masters, needs_grad_scaler

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("autoprec.integrations.hf needs transformers and accelerate: "
                      "pip install 'autoprec[examples]'") from err


class PolicyTrainer(Trainer):
    """``transformers.Trainer`` that trains under an autoprec policy (see module docs).

    Extra keyword arguments: ``policy`` (a Policy or a policy file), ``fp8_backend`` (the
    fp8 layers' backend, as ``apply_policy``'s; the train form prefers torchao's float8
    training where its fp8 kernels run), ``force`` (apply a policy whose fingerprint does
    not match, with a warning), ``init_scale`` (the GradScaler's first scale, 2**16).
    """

    def __init__(self, *args: Any, policy: Policy | str | Path, fp8_backend: str | None = None,
                 force: bool = False, init_scale: float = 2.0**16, **kwargs: Any) -> None:
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
        self._init_scale = init_scale
        self.policy_handle: PolicyHandle | None = None
        super().__init__(*args, **kwargs)
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
        attach_scaler(acc, CountingGradScaler(acc.device.type, init_scale=self._init_scale)
                      if self._needs_scaler else None)

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
        """Optimizer steps the GradScaler skipped (inf/nan gradients); 0 without one."""
        s = self.scaler
        return s.skipped_steps if isinstance(s, CountingGradScaler) else 0

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if isinstance(self.scaler, CountingGradScaler) and "loss" in logs:
            logs = {**logs, "loss_scale": self.loss_scale or 0.0,
                    "skipped_steps": float(self.skipped_steps)}
        super().log(logs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; its metrics gain ``train_skipped_steps`` (and
        ``train_loss_scale``, ``train_optimizer_steps``) when a GradScaler ran."""
        out = super().train(*args, **kwargs)
        if isinstance(self.scaler, CountingGradScaler):
            out.metrics.update({f"train_{k}": v for k, v in self.scaler.counts().items()})
        return out

    def remove_policy(self) -> None:
        """Uninstall the policy: the model's original forwards are restored."""
        if self.policy_handle is not None:
            self.policy_handle.remove()


__all__ = ["PolicyTrainer"]
