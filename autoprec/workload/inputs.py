"""The model and data a command works on: a model in hand, or a model.py.

``spec_of`` turns what a Python caller holds — an ``nn.Module`` and iterables of batches
(a list, a generator, a ``torch.utils.data.DataLoader``) — into the ``ModelSpec`` every
stage reads; a ``str`` / ``Path`` is a model.py or a checkpoint folder
(``checkpoint_spec.load_model``), the CLI's way
to produce the same arguments, and a ``ModelSpec`` passes through. A model in hand gets
the checks model.py gets (``loading``), each one line naming the argument:

- the model is an ``nn.Module`` (not TorchScript) with fp32, bf16 or fp16 weights;
- the data is an iterable of batches, read once and kept (a DataLoader that shuffles is
  read in one order, the one every stage then sees): a bare tensor or a dict is refused,
  so are more than ``loading.MAX_BATCHES`` batches, no batch and a batch of 0 rows;
- ``forward`` / ``metric`` / ``loss`` are callables; ``metric()`` must give one number and
  ``loss()`` a scalar tensor on every call (``ModelSpec``'s wrappers);
- ``name`` (default: the model's class name) is a plain name: it names the policy file,
  the study and the report folder.

``kept_as_given`` holds the caller's model as it was: its modules' train/eval flags and its
parameters' ``requires_grad`` are put back after the command (the stages run it in eval
mode); the stages themselves leave weights, gradients and forwards as they found them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import InputError
from autoprec.io.fileio import brief
from autoprec.io.paths import unwrap_model
from autoprec.workload.checkpoint_spec import load_model
from autoprec.workload.loading import (
    PLAIN_NAME,
    WEIGHT_DTYPES,
    ModelSpec,
    check_has_data,
    collect_batches,
    default_forward,
)

Batch = Any
#: What a command accepts as the model: a model.py path, a ModelSpec, or a module in hand.
ModelLike = str | Path | ModelSpec | torch.nn.Module


def _callable(value: Any, caller: str, what: str) -> Any:
    if value is not None and not callable(value):
        raise InputError(f"{caller}: {what} must be a function, got {type(value).__name__}")
    return value


def _name(model: torch.nn.Module, name: str | None, caller: str) -> str:
    if name is None:
        name = type(unwrap_model(model)).__name__
        return name if PLAIN_NAME.fullmatch(name) else "model"
    if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name):
        raise InputError(f"{caller}: name must be a plain name (letters, digits, '.', '_', "
                         f"'-'; not starting with '.'; it names files), got {brief(name)}")
    return name


def _check_module(model: torch.nn.Module, caller: str) -> None:
    if isinstance(unwrap_model(model), torch.jit.ScriptModule):
        raise InputError(f"{caller}: model is a TorchScript module ({type(model).__name__}); "
                         "autoprec tunes and applies the eager nn.Module: pass it before "
                         "torch.jit.script / torch.jit.trace")
    for pname, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in WEIGHT_DTYPES:
            raise InputError(f"{caller}: the model's weights must be fp32, bf16 or fp16; "
                             f"parameter {pname!r} is {str(p.dtype).replace('torch.', '')}")
    check_has_data(model, f"{caller}: model")


def spec_of(model: ModelLike, *, calibration: Iterable[Batch] | None = None,
            eval: Iterable[Batch] | None = None,  # noqa: A002  (the contract's word)
            forward: Callable[[torch.nn.Module, Batch], Any] | None = None,
            metric: Callable[[Any, Batch], float] | None = None,
            loss: Callable[[Any, Batch], torch.Tensor] | None = None,
            name: str | None = None, caller: str = "tune", masters: bool = False) -> ModelSpec:
    """The ``ModelSpec`` of ``model`` (see the module docs). ``caller`` names the function in
    messages (``tune: calibration is one tensor …``). The data arguments go with a model in
    hand; with a model.py or a ModelSpec they are refused (the file says them)."""
    given = {k: v for k, v in (("calibration", calibration), ("eval", eval),
                               ("forward", forward), ("metric", metric), ("loss", loss),
                               ("name", name)) if v is not None}
    if isinstance(model, (str, Path, ModelSpec)):
        if given:
            what = "model.py" if not isinstance(model, ModelSpec) else "the ModelSpec"
            raise InputError(f"{caller}: {', '.join(given)} go with a model in hand (an "
                             f"nn.Module); {what} gives its own")
        return model if isinstance(model, ModelSpec) else load_model(model, masters=masters)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{caller}: model must be a torch.nn.Module, the path of a model.py "
                         f"or a ModelSpec, got {type(model).__name__}")
    _check_module(model, caller)
    if calibration is None:
        raise InputError(f"{caller}: calibration= is required with a model in hand: an "
                         "iterable of batches (a list, a DataLoader) the model takes")
    label = _name(model, name, caller)
    calib = collect_batches(calibration, caller, "calibration", verb="is")
    held = collect_batches(eval, caller, "eval", verb="is") if eval is not None else None
    return ModelSpec(
        path=None, name=label, build_model=lambda: model,
        calibration_data=lambda: calib,
        eval_data=(lambda: held) if held is not None else None,
        forward=_callable(forward, caller, "forward") or default_forward,
        metric=_callable(metric, caller, "metric"), loss=_callable(loss, caller, "loss"))


@contextlib.contextmanager
def kept_as_given(model: Any) -> Iterator[None]:
    """Put a module's train/eval flags and its parameters' ``requires_grad`` back on exit
    (anything but an ``nn.Module``: nothing to keep)."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for m, flag in modes:
            m.training = flag
        for p, flag in grads:
            p.requires_grad_(flag)


__all__ = ["ModelLike", "kept_as_given", "spec_of"]
