"""Content hashes of data, weights and code (the fingerprint covers only the structure).

Used for the probe cache key and for what a tuning study depends on (provenance,
"is this the same study?"): one definition, so both agree. ``code_hash`` ties a study to
the code that produced its numbers: the model.py file, the functions model.py provides
(wherever they are defined) and the source of the model's own module classes — an edit
of ``forward()``, ``metric()`` or a module's ``forward`` makes a new study, not a reuse of
numbers the old code produced.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from autoprec.workload.loading import USER_MODULE_PREFIX


def _feed(h: Any, obj: Any) -> None:
    """Hash values, shapes and dtypes of tensors inside nested containers."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        # the tensor's own bytes (no copy: a 1 GB embedding is hashed in place)
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(obj, Mapping) or (hasattr(obj, "keys") and hasattr(obj, "values")):
        h.update(b"{")
        for k in obj:
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (tuple, list)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def data_hash(batches: Iterable[Any]) -> str:
    """``sha256:…`` of the batches' tensors (values, shapes, dtypes) and other members."""
    h = hashlib.sha256()
    _feed(h, list(batches))
    return "sha256:" + h.hexdigest()


def weights_hash(model: torch.nn.Module) -> str:
    """``sha256:…`` of the parameter and buffer values, by name; for a model streamed from a
    checkpoint (``autoprec.stream``), of the checkpoint's index, headers, sizes and mtimes
    (never the whole model in memory)."""
    stream = getattr(model, "autoprec_stream", None)
    if stream is not None:
        return stream.weights_hash()
    h = hashlib.sha256()
    for name, t in model.state_dict(keep_vars=False).items():
        h.update(name.encode())
        _feed(h, t)
    return "sha256:" + h.hexdigest()


#: autoprec's own modules hashed under the names they had when studies were first named.
#: A function autoprec provides (``default_forward`` when model.py has no ``forward``) is
#: hashed with its module's name, which is part of every study's name and probe cache key;
#: moving autoprec's code into packages (issue 48) must not rename the studies and
#: invalidate the caches a user already has. A module moved later joins this table.
HASHED_AS = {
    "autoprec.device.capability": "autoprec.capability",
    "autoprec.device.targets": "autoprec.targets",
    "autoprec.formats.precisions": "autoprec.precisions",
    "autoprec.io.extras": "autoprec.extras",
    "autoprec.io.fileio": "autoprec.fileio",
    "autoprec.io.paths": "autoprec.paths",
    "autoprec.io.validate": "autoprec.validate",
    "autoprec.training.loss_scaler": "autoprec.loss_scaler",
    "autoprec.training.short_run": "autoprec.train_check",
    "autoprec.training.train": "autoprec.train",
    "autoprec.tuning.memory": "autoprec.memory",
    "autoprec.workload.hashing": "autoprec.hashing",
    "autoprec.workload.inputs": "autoprec.inputs",
    "autoprec.workload.loading": "autoprec.loading",
    "autoprec.workload.metrics": "autoprec.metrics",
    "autoprec.workload.reference": "autoprec.reference",
    "autoprec.workload.scoring": "autoprec.scoring",
}


def _module(obj: Any) -> str:
    """The module name, with model.py's import name (it holds a hash of the file's
    path) replaced by "model.py": the same code in another checkout hashes the same;
    autoprec's moved modules by their ``HASHED_AS`` names."""
    name = str(getattr(obj, "__module__", "") or "")
    return "model.py" if name.startswith(USER_MODULE_PREFIX) else HASHED_AS.get(name, name)


def _code_blob(code: Any) -> str:
    """Bytecode, constants and names of a code object, nested ones included (their repr
    carries a memory address, so they are expanded instead)."""
    parts = [code.co_code.hex(), repr(code.co_names)]
    for c in code.co_consts:
        parts.append(_code_blob(c) if inspect.iscode(c) else repr(c))
    return "|".join(parts)


def function_code(fn: Callable[..., Any] | None) -> str:
    """What identifies a user function: its qualified name and source (bytecode where the
    source is unavailable); wrappers (functools.wraps) are seen through."""
    if fn is None:
        return ""
    fn = inspect.unwrap(fn)
    name = f"{_module(fn)}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    try:
        return name + "\n" + inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        return name + "\n" + (_code_blob(code) if code is not None else repr(fn))


def module_code_hash(model: torch.nn.Module) -> str:
    """``sha256:…`` of the source of the model's module classes and their bases. torch's
    own classes are left out (the torch version stands for them), and so are those of
    installed packages (site-packages): their package's version stands for them (reading
    transformers' sources would cost a second per call). A class without source (built at
    run time, a C extension) contributes its name and the bytecode of its ``forward``."""
    h = hashlib.sha256()
    classes: dict[str, type] = {}
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls is object or cls.__module__.split(".")[0] == "torch":
                continue
            classes.setdefault(f"{_module(cls)}.{cls.__qualname__}", cls)
    for name in sorted(classes):
        h.update(name.encode())
        h.update(_class_code(classes[name]).encode())
    return "sha256:" + h.hexdigest()


def _class_code(cls: type) -> str:
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:  # a built-in or C extension class
        file = None
    if file is not None and {"site-packages", "dist-packages"} & set(Path(file).parts):
        top = cls.__module__.split(".")[0]
        try:
            return f"{top}=={importlib.metadata.version(top)}"
        except (importlib.metadata.PackageNotFoundError, ValueError):
            pass
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return function_code(cls.__dict__.get("forward"))


#: A model.py larger than this is not hashed whole (its functions and classes still are).
_MAX_SOURCE_BYTES = 64 << 20


def code_hash(spec: Any, model: torch.nn.Module | None = None) -> str:
    """``sha256:…`` of what a study's numbers depend on in code: the bytes of ``spec.path``
    (model.py), the source of the spec's functions (build_model, calibration_data,
    eval_data, forward, metric, loss) and, given ``model``, of its module classes."""
    h = hashlib.sha256()
    path = getattr(spec, "path", None)  # None: a model handed over in Python, no file
    try:
        if path is not None and Path(path).is_file() \
                and Path(path).stat().st_size <= _MAX_SOURCE_BYTES:
            h.update(Path(path).read_bytes())
    except OSError:
        pass
    for attr in ("build_model", "calibration_data", "eval_data", "forward", "metric", "loss"):
        h.update(f"\0{attr}\0{function_code(getattr(spec, attr, None))}".encode())
    if model is not None:
        h.update(module_code_hash(model).encode())
    return "sha256:" + h.hexdigest()
