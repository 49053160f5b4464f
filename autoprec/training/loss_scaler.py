"""A ``torch.amp.GradScaler`` that counts the optimizer steps it took and skipped.

Whoever drives the scaler — ``train.train_step``, an ``accelerate`` loop, HF ``Trainer``
through ``PolicyTrainer`` — calls ``update()`` once per optimizer step; ``update()`` lowers
the scale (by ``backoff_factor``) exactly when ``step()`` found inf/nan gradients and
skipped the optimizer step, and keeps or grows it otherwise. Counting there makes the
number of skipped fp16 steps one fact, read the same way by every integration.
"""

from __future__ import annotations

import torch


class CountingGradScaler(torch.amp.GradScaler):
    """``GradScaler`` with ``steps`` (updates) and ``skipped_steps`` (updates that lowered
    the scale: the optimizer step was skipped for inf/nan gradients)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.steps = 0
        self.skipped_steps = 0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self.is_enabled():
            super().update(new_scale)
            return
        before = self.get_scale()
        super().update(new_scale)
        self.steps += 1
        if new_scale is None and self.get_scale() < before:
            self.skipped_steps += 1

    def counts(self) -> dict[str, float]:
        """``{"loss_scale", "optimizer_steps", "skipped_steps"}`` for logs and metrics."""
        return {"loss_scale": float(self.get_scale()), "optimizer_steps": float(self.steps),
                "skipped_steps": float(self.skipped_steps)}


__all__ = ["CountingGradScaler"]
