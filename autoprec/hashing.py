"""Content hashes of data and weights (the fingerprint covers only the structure).

Used for the probe cache key and for what a tuning study depends on (provenance,
"is this the same study?"): one definition, so both agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def _feed(h: Any, obj: Any) -> None:
    """Hash values, shapes and dtypes of tensors inside nested containers."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
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
    """``sha256:…`` of the parameter and buffer values, by name."""
    h = hashlib.sha256()
    for name, t in model.state_dict(keep_vars=False).items():
        h.update(name.encode())
        _feed(h, t)
    return "sha256:" + h.hexdigest()
