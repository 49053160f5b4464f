"""Load a user's model.py (the contract in DESIGN.md) into a ModelSpec.

Required: ``build_model()`` and ``calibration_data()``. Optional: ``eval_data()``,
``forward(model, batch)``, ``metric(outputs, batch)``, ``loss(outputs, batch)``.
Every failure is a ModelFileError (exit 2) naming the file and, when the user's own code
raised, showing their error.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import ModelFileError

Batch = Any


def default_forward(model: torch.nn.Module, batch: Batch) -> Any:
    """model(batch) for a tensor, model(*batch) for a tuple/list, model(**batch) for a dict."""
    # A tensor first: an fx Proxy standing for one answers hasattr(..., "keys") with True.
    if isinstance(batch, (torch.Tensor, torch.fx.Proxy)):
        return model(batch)
    if isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


@dataclass
class ModelSpec:
    """What model.py provides, with the defaults of the contract filled in."""

    path: Path
    name: str
    build_model: Callable[[], torch.nn.Module]
    calibration_data: Callable[[], Iterable[Batch]]
    eval_data: Callable[[], Iterable[Batch]] | None = None
    forward: Callable[[torch.nn.Module, Batch], Any] = default_forward
    metric: Callable[[Any, Batch], float] | None = None
    loss: Callable[[Any, Batch], torch.Tensor] | None = None

    def model(self) -> torch.nn.Module:
        """A fresh fp32 model in eval mode, checked against the contract."""
        try:
            model = self.build_model()
        except Exception as err:
            raise ModelFileError(f"{self.path}: build_model() raised {_describe(err)}") from err
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path}: build_model() must return a torch.nn.Module, "
                f"got {type(model).__name__}"
            )
        for pname, p in model.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ModelFileError(
                    f"{self.path}: build_model() must return fp32 weights; "
                    f"parameter {pname!r} is {str(p.dtype).replace('torch.', '')}"
                )
        return model.eval()

    def _batches(self, fn: Callable[[], Iterable[Batch]], what: str) -> list[Batch]:
        try:
            batches = list(fn())
        except Exception as err:
            raise ModelFileError(f"{self.path}: {what}() raised {_describe(err)}") from err
        if not batches:
            raise ModelFileError(f"{self.path}: {what}() yielded no batches")
        return batches

    def calibration_batches(self) -> list[Batch]:
        return self._batches(self.calibration_data, "calibration_data")

    def eval_batches(self) -> list[Batch]:
        """Held-out batches; the calibration batches when model.py has no eval_data."""
        if self.eval_data is None:
            return self.calibration_batches()
        return self._batches(self.eval_data, "eval_data")

    def run(self, model: torch.nn.Module, batch: Batch, index: int = 0, what: str = "") -> Any:
        """Forward one batch; a failure is the user's model rejecting the batch (exit 2)."""
        try:
            return self.forward(model, batch)
        except Exception as err:
            src = f" {what}" if what else ""
            raise ModelFileError(
                f"{self.path}: the model rejected batch {index}{src}: {_describe(err)}"
            ) from err


def _model_name(module: Any, path: Path) -> str:
    """MODEL_NAME from model.py, else the folder name for model.py, else the file stem."""
    explicit = getattr(module, "MODEL_NAME", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    return path.resolve().parent.name if path.stem == "model" else path.stem


def load_model_file(path: str | Path) -> ModelSpec:
    """Import model.py and return its ModelSpec; ModelFileError on any contract breach."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, expected a model.py file")
    if path.suffix != ".py":
        raise ModelFileError(f"{path}: not a Python file (expected a .py file)")
    mod_name = f"autoprec_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    # model.py may import helpers sitting next to it.
    parent = str(path.resolve().parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        sys.modules.pop(mod_name, None)
        raise ModelFileError(f"{path}:{err.lineno}: not valid Python: {err.msg}") from err
    except Exception as err:
        sys.modules.pop(mod_name, None)
        raise ModelFileError(f"{path}: importing it raised {_describe(err)}") from err
    finally:
        if added:
            sys.path.remove(parent)

    def fn(name: str, required: bool) -> Callable[..., Any] | None:
        f = getattr(module, name, None)
        if f is None:
            if required:
                raise ModelFileError(f"{path}: required function {name}() is missing")
            return None
        if not callable(f):
            raise ModelFileError(f"{path}: {name} must be a function")
        return f

    build = fn("build_model", True)
    calib = fn("calibration_data", True)
    assert build is not None and calib is not None  # required=True raised otherwise
    return ModelSpec(
        path=path,
        name=_model_name(module, path),
        build_model=build,
        calibration_data=calib,
        eval_data=fn("eval_data", False),
        forward=fn("forward", False) or default_forward,
        metric=fn("metric", False),
        loss=fn("loss", False),
    )
