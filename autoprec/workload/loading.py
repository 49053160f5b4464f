"""Load a user's model.py (the contract in docs/overview.md) into a ModelSpec.

Required: ``build_model()`` and ``calibration_data()``. Optional: ``eval_data()``,
``forward(model, batch)``, ``metric(outputs, batch)``, ``loss(outputs, batch)``.
Every failure is a ModelFileError (exit 2) naming the file and, when the user's own code
raised, showing their error. ``sys.exit()`` in model.py (at import or in one of its
functions) is reported the same way, never as a silent exit.

What is checked here, once, for every command:

- the file is a regular ``.py`` file (a FIFO would block the import forever);
- ``calibration_data()`` / ``eval_data()`` return an iterable of batches: a bare tensor or
  a dict is refused (iterating it would silently make each row, or each key, a batch); at
  most ``MAX_BATCHES`` batches and ``MAX_DATA_BYTES`` of tensors are taken (every batch is
  kept in memory: an endless generator is refused with that message, not followed until
  memory runs out); a batch with 0 rows is refused;
- ``metric()`` returns one number and ``loss()`` a scalar tensor, on every call.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import numbers
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import ModelFileError
from autoprec.io.fileio import brief, file_kind
from autoprec.workload.metrics import batch_size_of

#: model.py is imported as a module named this prefix + a hash of its resolved path.
USER_MODULE_PREFIX = "autoprec_user_model_"
#: At most this many batches are taken from calibration_data() / eval_data().
MAX_BATCHES = 1000
#: At most this many bytes of tensors in one data set (they are all kept in memory).
MAX_DATA_BYTES = 8 << 30

Batch = Any
#: Weight dtypes build_model() may return: the model as given is the reference.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    if len(first) > 300:  # the user's message, quoted: bounded like every other value
        first = first[:300] + "…"
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _failed(what: str, err: BaseException) -> str:
    """'build_model() raised ValueError: …' or 'build_model() called sys.exit(3)'."""
    if isinstance(err, SystemExit):
        return f"{what} called sys.exit({brief(err.code) if err.code is not None else ''})"
    return f"{what} raised {_describe(err)}"


def _nbytes(obj: Any, depth: int = 0) -> int:
    """Bytes of the tensors inside a batch (tensors, mappings, tuples, lists)."""
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.numel()
    if depth > 8:
        return 0
    if isinstance(obj, Mapping):
        return sum(_nbytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(v, depth + 1) for v in obj)
    return 0


def _shape(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return str(tuple(batch.shape))
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        for v in batch:
            if isinstance(v, torch.Tensor):
                return str(tuple(v.shape))
    return "?"


def as_number(path: Path | str, value: Any) -> float:
    """What metric() returned, as a float; ModelFileError unless it is one number."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "item")):
        shape = tuple(getattr(value, "shape", ()))
        size = 1
        for d in shape:
            size *= int(d)
        if size != 1:
            raise ModelFileError(f"{path}: metric() must return one number, got a "
                                 f"{type(value).__name__} of shape {shape} (reduce it, e.g. "
                                 ".mean().item())")
        value = value.item()
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            raise ModelFileError(f"{path}: metric() returned {brief(value)}, too large for "
                                 "a float") from None
    raise ModelFileError(f"{path}: metric() must return one number, got "
                         f"{type(value).__name__} {brief(value)}")


def _checked_metric(path: Path | str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], float]:
    @functools.wraps(fn)
    def metric(outputs: Any, batch: Any) -> float:
        try:
            value = fn(outputs, batch)
        except (Exception, SystemExit) as err:
            raise ModelFileError(f"{path}: {_failed('metric()', err)}") from err
        return as_number(path, value)

    metric.__autoprec_checked__ = True  # type: ignore[attr-defined]
    return metric


def _has_grad(value: Any, depth: int = 0) -> bool:
    """Some tensor in ``value`` (tensors, tuples, lists, dicts, ModelOutput) needs a grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if depth > 4:
        return False
    if isinstance(value, dict):
        return any(_has_grad(v, depth + 1) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_has_grad(v, depth + 1) for v in value[:64])
    return False


def _checked_loss(path: Path | str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    @functools.wraps(fn)
    def loss(outputs: Any, batch: Any) -> torch.Tensor:
        try:
            value = fn(outputs, batch)
        except (Exception, SystemExit) as err:
            raise ModelFileError(f"{path}: {_failed('loss()', err)}") from err
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            got = (f"a {value.dtype} tensor" if isinstance(value, torch.Tensor)
                   else f"{type(value).__name__} {brief(value)}")
            raise ModelFileError(f"{path}: loss() must return a floating scalar tensor "
                                 f"(one number to minimise, with gradients), got {got}")
        if value.numel() != 1:
            raise ModelFileError(f"{path}: loss() must return a scalar tensor, got shape "
                                 f"{tuple(value.shape)} (reduce it, e.g. .mean())")
        if torch.is_grad_enabled() and not value.requires_grad and _has_grad(outputs):
            raise ModelFileError(f"{path}: loss() returned a tensor with no gradient although "
                                 "the outputs have one (computed under torch.no_grad() or "
                                 "detached?); gradient probes and --train-aware backpropagate "
                                 "through loss()")
        return value

    loss.__autoprec_checked__ = True  # type: ignore[attr-defined]
    return loss


def check_has_data(model: torch.nn.Module, where: str) -> None:
    """Every parameter and buffer of ``model`` holds its values: ModelFileError (exit 2)
    naming the first on the ``meta`` device (no data: offloaded by accelerate's
    ``device_map`` / ``disk_offload``, or made under ``init_empty_weights``). autoprec
    reads, hashes and copies every weight. A model streamed block by block from its
    checkpoint folder (``autoprec.stream``: ``model.autoprec_stream``) loads its meta
    blocks as they run, and is accepted."""
    if getattr(model, "autoprec_stream", None) is not None:
        return
    for kind, named in (("parameter", model.named_parameters()),
                        ("buffer", model.named_buffers())):
        for name, t in named:
            if t.device.type == "meta":
                folder = _checkpoint_folder(model)
                raise ModelFileError(
                    f"{where}: {kind} {name!r} is on the meta device (no data: offloaded by "
                    "accelerate's device_map/disk_offload, or made under "
                    "init_empty_weights); autoprec reads every weight: load the model "
                    "without offloading (device_map=None), or give autoprec its checkpoint "
                    "folder, which it streams block by block"
                    + (f" (autoprec tune {folder})" if folder else ""))


def _checkpoint_folder(model: torch.nn.Module) -> str | None:
    """The local checkpoint folder a transformers model was loaded from (its config's
    ``_name_or_path``), when it is one autoprec can stream."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path:
        return None
    from autoprec.stream.checkpoint import is_checkpoint_dir

    try:
        return str(path) if is_checkpoint_dir(path) else None
    except OSError:
        return None


def collect_batches(data: Any, owner: str, what: str, verb: str = "returned"
                    ) -> list[Batch]:
    """The batches of ``data`` (an iterable: a list, a generator, a DataLoader), checked
    and kept in a list. Messages read ``{owner}: {what} {verb} …`` (``model.py:
    calibration_data() returned …``, ``tune: calibration is …``). Refused, each in one
    ModelFileError: a bare tensor or a mapping (iterating it would make each row, or each
    key, a batch), something not iterable, more than ``MAX_BATCHES`` batches or
    ``MAX_DATA_BYTES`` of tensors (every batch is kept in memory: an endless generator), no
    batch, a batch of 0 rows, an error raised while iterating."""
    where = f"{owner}: {what}"
    if isinstance(data, torch.Tensor):
        raise ModelFileError(
            f"{where} {verb} one tensor of shape {tuple(data.shape)}; return a list "
            "of batches, e.g. [x] or list(x.split(32)) (iterating a tensor would make "
            "each row a batch)")
    if isinstance(data, (Mapping, str, bytes)):
        raise ModelFileError(
            f"{where} {verb} a {type(data).__name__}; return a list of batches, "
            "e.g. [batch] (iterating it would make each key a batch)")
    if not isinstance(data, Iterable):
        raise ModelFileError(f"{where} {verb} a {type(data).__name__}, not an iterable of "
                             "batches (a list, a generator or a DataLoader)")
    batches: list[Batch] = []
    total = 0
    try:
        for batch in data:
            if len(batches) == MAX_BATCHES:
                raise ModelFileError(
                    f"{where} yields more than {MAX_BATCHES} batches (an endless "
                    "generator?); autoprec keeps every batch in memory: give at most "
                    f"{MAX_BATCHES}, e.g. itertools.islice(batches, 64)")
            total += _nbytes(batch)
            if total > MAX_DATA_BYTES:
                raise ModelFileError(
                    f"{where} yields more than {MAX_DATA_BYTES >> 30} GiB of tensors "
                    f"in {len(batches) + 1} batches; autoprec keeps every batch in "
                    "memory: give fewer or smaller batches")
            batches.append(batch)
    except ModelFileError:
        raise
    except (Exception, SystemExit) as err:
        raise ModelFileError(f"{owner}: {_failed(what, err)}") from err
    if not batches:
        raise ModelFileError(f"{where} yielded no batches")
    for i, batch in enumerate(batches):
        if batch_size_of(batch) == 0:
            raise ModelFileError(f"{owner}: batch {i} of {what} has 0 rows "
                                 f"(shape {_shape(batch)}); leave empty batches out")
    return batches


@dataclass
class ModelSpec:
    """What model.py provides, with the defaults of the contract filled in.

    ``path`` is the model.py file; None for a model handed over in Python
    (``autoprec.workload.inputs.spec_of``): messages then name the model (``where``).
    """

    path: Path | None
    name: str
    build_model: Callable[[], torch.nn.Module]
    calibration_data: Callable[[], Iterable[Batch]]
    eval_data: Callable[[], Iterable[Batch]] | None = None
    forward: Callable[[torch.nn.Module, Batch], Any] = default_forward
    metric: Callable[[Any, Batch], float] | None = None
    loss: Callable[[Any, Batch], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        # metric() must give one number and loss() a scalar tensor on every call, the
        # fp32 reference and the probes' calls included (code_hash sees through the wrap).
        if self.metric is not None and not getattr(self.metric, "__autoprec_checked__", False):
            self.metric = _checked_metric(self.where, self.metric)
        if self.loss is not None and not getattr(self.loss, "__autoprec_checked__", False):
            self.loss = _checked_loss(self.where, self.loss)

    @property
    def where(self) -> str:
        """What messages name: the model.py file, else ``model NAME`` (a model in hand)."""
        return str(self.path) if self.path is not None else f"model {self.name!r}"

    def model(self) -> torch.nn.Module:
        """A fresh model in eval mode (fp32, bf16 or fp16 weights), checked against the
        contract."""
        try:
            model = self.build_model()
        except (Exception, SystemExit) as err:
            raise ModelFileError(f"{self.where}: {_failed('build_model()', err)}") from err
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.where}: build_model() must return a torch.nn.Module, "
                f"got {type(model).__name__}"
            )
        if isinstance(model, torch.jit.ScriptModule):
            # A scripted module runs its compiled graph: no Python forward to wrap in a
            # region, no hooks for the probes, no named_modules() rules can reach.
            raise ModelFileError(
                f"{self.where}: build_model() returned a TorchScript module "
                f"({type(model).__name__}); autoprec tunes and applies the eager "
                "nn.Module: return it before torch.jit.script / torch.jit.trace")
        for pname, p in model.named_parameters():
            # The model as given is the reference (autoprec.workload.reference): fp32, bf16 or fp16
            # weights, mixed too (HF's _keep_in_fp32_modules); fp64 and fp8 are not.
            if p.is_floating_point() and p.dtype not in WEIGHT_DTYPES:
                raise ModelFileError(
                    f"{self.where}: build_model() must return fp32, bf16 or fp16 weights; "
                    f"parameter {pname!r} is {str(p.dtype).replace('torch.', '')}"
                )
        check_has_data(model, f"{self.where}: build_model()")
        return model.eval()

    def _batches(self, fn: Callable[[], Iterable[Batch]], what: str) -> list[Batch]:
        try:
            data = fn()
        except (Exception, SystemExit) as err:
            raise ModelFileError(f"{self.where}: {_failed(what + '()', err)}") from err
        return collect_batches(data, self.where, what + "()")

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
        except ModelFileError:
            raise  # metric()/loss() inside a user forward: already named
        except (Exception, SystemExit) as err:
            src = f" {what}" if what else ""
            why = _failed("forward()", err) if isinstance(err, SystemExit) else _describe(err)
            raise ModelFileError(
                f"{self.where}: the model rejected batch {index}{src}: {why}"
            ) from err


def _model_name(module: Any, path: Path) -> str:
    """MODEL_NAME from model.py, else the folder name for model.py, else the file stem."""
    explicit = getattr(module, "MODEL_NAME", None)
    if isinstance(explicit, str) and explicit:
        # It names files (policies/NAME-TARGET.yaml, the study and cache): a plain name,
        # never a path that would write outside policies/.
        if not PLAIN_NAME.fullmatch(explicit):
            raise ModelFileError(f"{path}: MODEL_NAME must be a plain name (letters, digits, "
                                 f"'.', '_', '-'; not starting with '.'), got {brief(explicit)}")
        return explicit
    return path.resolve().parent.name if path.stem == "model" else path.stem


#: A MODEL_NAME usable as a file-name part.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def _nul_line(path: Path) -> int | None:
    """The line of the first NUL byte (Python reports none for "cannot contain null bytes")."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    at = blob.find(b"\0")
    return None if at < 0 else blob.count(b"\n", 0, at) + 1


def load_model_file(path: str | Path) -> ModelSpec:
    """Import model.py and return its ModelSpec; ModelFileError on any contract breach
    (``checkpoint_spec.load_model`` also takes a checkpoint folder)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except OSError as err:
        raise ModelFileError(f"{path}: cannot read: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        raise ModelFileError(f"{path}: is a directory, expected a model.py file or a "
                             "checkpoint folder (with a config.json)")
    if path.suffix != ".py":
        raise ModelFileError(f"{path}: not a Python file (expected a .py file)")
    if not stat.S_ISREG(mode):  # importing a FIFO would block forever
        raise ModelFileError(f"{path}: is {file_kind(mode)}, not a regular file")
    # Deterministic (str hash() is salted per process): the name appears in code hashes.
    mod_name = USER_MODULE_PREFIX + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
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
        line = err.lineno if err.lineno is not None else _nul_line(path)
        where = f"{path}:{line}" if line is not None else str(path)
        raise ModelFileError(f"{where}: not valid Python: {err.msg}") from err
    except (Exception, SystemExit) as err:
        sys.modules.pop(mod_name, None)
        raise ModelFileError(f"{path}: {_failed('importing it', err)}") from err
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
