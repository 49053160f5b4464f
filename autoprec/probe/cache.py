"""On-disk cache of probe tables.

The key covers everything a table depends on: the model's structure fingerprint *and*
its weight values (a fine-tuned model keeps its fingerprint), the calibration data, the
precisions and probe options, the user's forward/loss/metric code and the source of the
model's module classes (an edited ``Module.forward`` is a new key), and the versions of
autoprec, torch and the table schema. Tables are JSON (no pickle: a cache directory may be
shared), written atomically (temp file, fsync, rename) so a killed run leaves no torn
file; a streamed probe's partial stages (``stages``) are read by torch's weights-only
reader, which builds none but the probe's own classes. The cache is an optimisation: a cache that cannot be written (a full disk, a
read-only folder) is a warning, and the probe's result is returned all the same.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec._version import __version__
from autoprec.errors import OutputError
from autoprec.io.fileio import MiB, atomic_write, read_regular
from autoprec.probe.table import SCHEMA, SensitivityTable
from autoprec.trace.graph import fingerprint
from autoprec.workload.hashing import data_hash, function_code, module_code_hash, weights_hash


def function_hash(fn: Callable[..., Any] | None) -> str:
    """Identity of a user function: its qualified name and source (None -> "")."""
    if fn is None:
        return ""
    return hashlib.sha256(function_code(fn).encode()).hexdigest()[:16]


#: Bumped when what a lowering computes changes between releases, so that tables measured
#: by the earlier code are not read back: 2, a 16-bit model's fp32 buffers kept in the
#: deploy form (``apply.stored``).
NUMERICS = 2


def cache_key(model: nn.Module, batches: Iterable[Any], options: Mapping[str, Any]) -> str:
    """sha256 of model structure + weights, data, options and versions."""
    parts = {
        "fingerprint": fingerprint(model),
        "weights": weights_hash(model),
        "modules": module_code_hash(model),
        "data": data_hash(batches),
        "options": {k: options[k] for k in sorted(options)},
        "versions": {"autoprec": __version__, "torch": torch.__version__,
                     "schema": SCHEMA, "numerics": NUMERICS},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def cache_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / f"probe-{key[:40]}.json"


#: A cached table larger than this is ignored (a table of 10,000 layers is a few MiB).
MAX_CACHE_BYTES = 256 * MiB


def load(cache_dir: str | Path, key: str) -> SensitivityTable | None:
    """The cached table for ``key``, or None (missing, other schema, unreadable)."""
    path = cache_path(cache_dir, key)
    try:
        if not path.exists():
            return None
        data = json.loads(read_regular(path, MAX_CACHE_BYTES, "probe cache file",
                                       OutputError))
        if data.get("meta", {}).get("cache_key") != key:
            return None
        return SensitivityTable.from_json(data)
    except (OutputError, OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        warnings.warn(f"{path}: ignoring unreadable probe cache ({err})", stacklevel=2)
        return None


def store(cache_dir: str | Path, key: str, table: SensitivityTable) -> Path | None:
    """Write ``table`` under ``key`` atomically; returns the file (None: not written — a
    warning says why; the table is still good)."""
    path = cache_path(cache_dir, key)
    try:
        return atomic_write(path, table.dumps())
    except OutputError as err:
        warnings.warn(f"probe cache not written: {err}", stacklevel=2)
        return None
