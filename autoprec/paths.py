"""Module paths: wrapper prefixes are normalised so policies match wrapped models."""

from __future__ import annotations

import torch

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
