"""On-disk cache of probe tables.

The key covers everything a table depends on: the model's structure fingerprint *and*
its weight values (a fine-tuned model keeps its fingerprint), the calibration data, the
precisions and probe options, the user's forward/loss/metric code, and the versions of
autoprec, torch and the table schema. Files are JSON (no pickle: a cache directory may be
shared), written atomically (temp file + rename) so a killed run leaves no torn file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoprec
from autoprec.hashing import data_hash, weights_hash
from autoprec.probe.table import SCHEMA, SensitivityTable
from autoprec.trace.graph import fingerprint


def code_hash(fn: Callable[..., Any] | None) -> str:
    """Identity of a user function: its qualified name and bytecode (None -> "")."""
    if fn is None:
        return ""
    code = getattr(fn, "__code__", None)
    blob = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    if code is not None:
        blob += code.co_code.hex() + repr(code.co_consts)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_key(model: nn.Module, batches: Iterable[Any], options: Mapping[str, Any]) -> str:
    """sha256 of model structure + weights, data, options and versions."""
    parts = {
        "fingerprint": fingerprint(model),
        "weights": weights_hash(model),
        "data": data_hash(batches),
        "options": {k: options[k] for k in sorted(options)},
        "versions": {"autoprec": autoprec.__version__, "torch": torch.__version__,
                     "schema": SCHEMA},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def cache_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / f"probe-{key[:40]}.json"


def load(cache_dir: str | Path, key: str) -> SensitivityTable | None:
    """The cached table for ``key``, or None (missing, other schema, unreadable)."""
    path = cache_path(cache_dir, key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("meta", {}).get("cache_key") != key:
            return None
        return SensitivityTable.from_json(data)
    except (OSError, ValueError, TypeError, KeyError) as err:
        warnings.warn(f"{path}: ignoring unreadable probe cache ({err})", stacklevel=2)
        return None


def store(cache_dir: str | Path, key: str, table: SensitivityTable) -> Path:
    """Write ``table`` under ``key`` atomically; returns the file."""
    path = cache_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".probe-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(table.dumps())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
