"""What a user does to a model after ``apply_policy``: train it, change its dtype, move it.

- **A backward into the deploy form's weights is refused.** The deploy form stores each
  layer's weights as 16-bit or quantised copies and keeps the fp32 masters aside;
  ``remove()`` puts the masters back. An optimizer stepping the copies would change a
  model whose every update ``remove()`` then discards, and an update smaller than half a
  bf16 step (lr × grad below 2⁻⁹ of the weight) is rounded away on each step anyway.
  Each copy that requires grad gets a tensor hook that raises one InputError when a
  gradient reaches it (in ``loss.backward()``, before any optimizer step): the user is
  sent to the train form (fp32 masters, autocast regions, GradScaler). Gradients that
  reach only fp32 layers (a plan's fp32 islands hold the masters themselves) and input
  gradients (``torch.autograd.grad`` w.r.t. the inputs) are not refused: nothing is lost.
- **A dtype change is refused, before anything is changed.** ``model.float()`` /
  ``.half()`` / ``.to(dtype)`` on a model under a policy would leave the plan's
  per-region casts feeding weights of another dtype (the next forward failed inside
  torch: "mat1 and mat2 must have the same dtype"). Every module's ``_apply`` (the one
  method through which ``to`` / ``float`` / ``half`` / ``cuda`` / ``type`` change tensors)
  first runs the conversion on an empty tensor of each floating dtype the module holds;
  one that comes back in another dtype is refused with one InputError.
- **A device move keeps working** (``.to("cuda")``, ``.cpu()``, ``to_empty``): the same
  probe sees the dtype kept and the conversion runs; ``apply.stored`` restores the masters
  on the device the model is on at ``remove()``, and the guard builds its re-run weights
  where the layer is.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from autoprec.errors import InputError

_MISSING = object()


def train_form_hint(source: str) -> str:
    return (f"{source} is applied in the deploy form: the model holds 16-bit / quantised "
            "copies of its weights and remove() puts the untouched fp32 masters back, so "
            "training these copies would be lost; train with form: train "
            "(apply_policy(model, policy, form='train'), autoprec.training.train.prepare_training "
            "or autoprec.integrations.hf.PolicyTrainer) — the deploy form is for inference")


class AfterApply:
    """The refusals above, installed on one applied model and taken off by ``remove()``."""

    def __init__(self, root: torch.nn.Module, source: str, form: str) -> None:
        self.root = root
        self.source = source
        self.form = form
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._applies: list[tuple[torch.nn.Module, Any]] = []
        self._converting = 0  # inside a checked _apply: its recursion is not re-checked
        self._paths = {id(m): p for p, m in root.named_modules()}

    # -- training ----------------------------------------------------------------------
    def refuse_backward(self, copies: list[torch.Tensor]) -> None:
        """A hook on each copy (requiring grad) that raises when a gradient reaches it."""
        msg = f"loss.backward() reached a deployed weight: {train_form_hint(self.source)}"

        def refuse(grad: torch.Tensor) -> torch.Tensor:
            raise InputError(msg)

        seen: set[int] = set()
        for t in copies:
            if t.requires_grad and id(t) not in seen:  # a tied copy once
                seen.add(id(t))
                self._hooks.append(t.register_hook(refuse))

    # -- dtype / device changes --------------------------------------------------------
    def guard_conversions(self) -> None:
        """Every module's ``_apply`` checks the conversion first (module doc)."""
        for mod in self.root.modules():
            old = mod.__dict__.get("_apply", _MISSING)
            self._applies.append((mod, old))
            mod._apply = self._checked(mod, old)  # type: ignore[method-assign]

    def _checked(self, module: torch.nn.Module, old: Any) -> Any:
        after = self

        def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                   *args: Any, **kwargs: Any) -> Any:
            if self is not module:  # a deepcopy of the model: a plain model
                return type(self)._apply(self, fn, *args, **kwargs)
            if not after._converting:
                after._check(module, fn)
            after._converting += 1
            try:
                if isinstance(old, types.MethodType):
                    return old(fn, *args, **kwargs)
                return type(self)._apply(self, fn, *args, **kwargs)
            finally:
                after._converting -= 1

        return types.MethodType(_apply, module)

    def _check(self, module: torch.nn.Module,
               fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Refuse ``fn`` when it changes the dtype of a floating tensor ``module`` holds."""
        kinds: dict[tuple[torch.dtype, torch.device], str] = {}
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point():
                kinds.setdefault((t.dtype, t.device), name)
        for (dtype, device), name in kinds.items():
            try:
                got = fn(torch.empty(0, dtype=dtype, device=device))
            except Exception:  # noqa: BLE001 — the real conversion will say what is wrong
                continue
            if isinstance(got, torch.Tensor) and got.dtype != dtype:
                prefix = self._paths.get(id(module), "")
                layer = ".".join(p for p in (prefix, name.rpartition(".")[0]) if p) or "<root>"
                raise InputError(
                    f"{self.source}: a dtype change after apply_policy (model.float() / "
                    f".half() / .to(dtype)) is refused, nothing was changed: layer "
                    f"{layer!r} holds {str(dtype)[6:]} and would become "
                    f"{str(got.dtype)[6:]}, but the policy ({self.form} form) sets each "
                    "layer's dtype; remove() the policy, change the dtype, then apply it "
                    "again")

    # -- undo ----------------------------------------------------------------------------
    def remove(self) -> None:
        """Take the hooks and the checked ``_apply`` methods off (idempotent)."""
        while self._hooks:
            self._hooks.pop().remove()
        while self._applies:
            mod, old = self._applies.pop()
            if old is _MISSING:
                mod.__dict__.pop("_apply", None)
            else:
                mod._apply = old  # type: ignore[method-assign]


__all__ = ["AfterApply", "train_form_hint"]
