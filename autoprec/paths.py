"""Module paths: wrapper prefixes are normalised so policies match wrapped models."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from autoprec.errors import InputError

#: Prefixes added by wrappers: torch.compile (OptimizedModule), DDP / DataParallel.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside torch.compile / DDP / DataParallel wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        if type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = model.module  # type: ignore[assignment]
            continue
        return model


def normalize_path(path: str) -> str:
    """Strip wrapper prefixes: ``_orig_mod.encoder.0`` -> ``encoder.0``."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if path.startswith(prefix):
                path = path[len(prefix) :]
                changed = True
        if path in ("_orig_mod", "module"):
            return ""
    return path


def covers(rule_path: str, path: str) -> bool:
    """True when a rule on ``rule_path`` applies to module ``path`` (itself or a child)."""
    return rule_path == "" or path == rule_path or path.startswith(rule_path + ".")


def check_out_path(path: Path) -> None:
    """An output file can be written at ``path``: InputError (exit 2) naming it otherwise."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give a file path such as "
                         f"{path / 'policy.yaml'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"{path}: cannot create {path.parent}: "
                         f"{err.strerror or err}") from err
    if not os.access(path.parent, os.W_OK):
        raise InputError(f"{path}: {path.parent} is not writable")
