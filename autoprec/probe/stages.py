"""Stage files of a long probe: a killed run resumes after the last stage it finished.

A streamed model's probe takes tens of minutes (an 8 B Llama on a CPU: the shadow pass
~12 min, each end-to-end run ~1 min). Beside the probe cache (``cache``: the finished
table, JSON) a probe of a streamed model keeps, under the same key, the shadow pass's
results once it is done and the end-to-end runs as each finishes; a run with the same key
reads them and goes on from there; the files go once the table is stored. The tune keeps
a streamed model's layer graph the same way (``trace`` files, kept: the trace's three
streamed forwards are ~14 min of an 8 B tune here).

They are written with ``torch.save`` (tensors and plain containers of the probe's own
classes), atomically, and read with ``torch.load``'s weights-only reader allowing those
classes alone: a stage file runs no code when read, as the JSON cache does not.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class Stages:
    """The stage files of the probe keyed ``key`` in ``cache_dir``; ``classes``: the
    classes a stage holds (allowed when read)."""

    def __init__(self, cache_dir: str | Path, key: str, classes: Sequence[type],
                 prefix: str = "probe") -> None:
        self.dir, self.key, self.classes = Path(cache_dir), key, list(classes)
        self.prefix = prefix

    def path(self, stage: str) -> Path:
        return self.dir / f"{self.prefix}-{self.key[:40]}.{stage}.pt"

    def load(self, stage: str) -> Any | None:
        """The stage's value, or None (not there, another key, unreadable: a warning)."""
        path = self.path(stage)
        if not path.is_file():
            return None
        try:
            with torch.serialization.safe_globals(self.classes):
                saved = torch.load(path, weights_only=True, map_location="cpu")
            if not isinstance(saved, dict) or saved.get("key") != self.key:
                return None
            return saved["value"]
        except Exception as err:  # noqa: BLE001 - a stage file is an optimisation
            warnings.warn(f"{path}: ignoring an unreadable probe stage file "
                          f"({type(err).__name__})", stacklevel=2)
            return None

    def store(self, stage: str, value: Any) -> None:
        """Write the stage atomically (a warning, not an error, when it cannot be)."""
        path = self.path(stage)
        tmp = path.with_name(path.name + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.save({"key": self.key, "value": value}, tmp)
            os.replace(tmp, path)
        except OSError as err:
            warnings.warn(f"probe stage {stage!r} not kept: {err}", stacklevel=2)
            tmp.unlink(missing_ok=True)

    def clear(self) -> None:
        for f in self.dir.glob(f"{self.prefix}-{self.key[:40]}.*.pt"):
            f.unlink(missing_ok=True)


__all__ = ["Stages"]
