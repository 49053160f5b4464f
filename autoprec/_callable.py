"""Let ``autoprec.trace(...)`` and ``autoprec.probe(...)`` be calls although ``trace`` and
``probe`` are also the packages of those stages (importing ``autoprec.trace.graph`` binds
the package to ``autoprec.trace``). The package module forwards calls to its function."""

from __future__ import annotations

import sys
import types
from typing import Any


def make_callable(module_name: str, function_name: str) -> None:
    module = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, function_name)(*args, **kwargs)

    module.__class__ = _CallableModule
