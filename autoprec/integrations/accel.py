"""A plain ``accelerate.Accelerator`` loop under an autoprec policy.

``Accelerator(mixed_precision="fp16")`` does what HF ``Trainer(fp16=True)`` does: a
GradScaler and a *global* ``torch.autocast`` around the model's forward, which would
override the policy's per-layer precisions. So the accelerator is built with
``mixed_precision="no"`` and given the policy's scaler (``prepare_training`` makes one iff
some layer computes in fp16); accelerate then scales the loss in ``backward``, unscales
before ``clip_grad_norm_``, and steps and updates through the scaler, skipping a step
whose gradients overflowed. Skipped steps are counted by the scaler itself
(``TrainingSetup.skipped_steps``)::

    from accelerate import Accelerator
    from autoprec.integrations.accel import use_accelerator
    from autoprec.training.train import prepare_training

    accelerator = Accelerator(gradient_accumulation_steps=2)   # mixed_precision "no"
    setup = prepare_training(model, "policy.yaml")              # policy on, fp32 masters
    use_accelerator(accelerator, setup)                         # before prepare(optimizer)
    model, opt, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters()),
                                             loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # as accelerate documents: once per step
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    print(setup.report())   # steps, skipped_steps, loss_scale, fp8_backend
    setup.remove()

Requires ``accelerate`` (``pip install autoprec[examples]``).
"""

from __future__ import annotations

import types
from typing import Any

from autoprec.errors import InputError
from autoprec.training.train import TrainingSetup


def unscale_gradients(self: Any, optimizer: Any = None) -> None:
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


def attach_scaler(accelerator: Any, scaler: Any) -> None:
    """Give ``accelerator`` (built with mixed_precision "no") ``scaler`` (or None): its
    ``backward``, optimizer steps and gradient clipping then use it."""
    accelerator.scaler = scaler
    if scaler is not None:
        accelerator.unscale_gradients = types.MethodType(unscale_gradients, accelerator)


def use_accelerator(accelerator: Any, setup: TrainingSetup) -> None:
    """Make ``accelerator`` train ``setup``'s model under its policy (see module docs).

    Raises InputError when the accelerator has a global autocast (``mixed_precision`` not
    "no": it would override the policy) or already prepared an optimizer (the scaler is
    handed to each optimizer as ``prepare`` wraps it).
    """
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp != "no":
        raise InputError(f"use_accelerator: Accelerator(mixed_precision={mp!r}) wraps the "
                         "forward in one global autocast that overrides the policy's "
                         "per-layer precisions; build it with mixed_precision='no' (the "
                         "policy decides; its GradScaler, when it has fp16 layers, is "
                         "attached here)")
    if getattr(accelerator, "_optimizers", None):
        raise InputError("use_accelerator: call it before accelerator.prepare(optimizer): "
                         "accelerate hands the scaler to each optimizer as it wraps it")
    attach_scaler(accelerator, setup.scaler)


__all__ = ["attach_scaler", "unscale_gradients", "use_accelerator"]
