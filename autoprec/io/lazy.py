"""A package's public names imported from their submodules on first use (PEP 562), so
importing the package stays cheap (torch, optuna and mlflow load when a name is used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose globals are ``namespace``.

    ``exports`` maps each public name to the submodule that holds it, relative to the
    package: ``"sub.module"`` (the same name there) or ``"sub.module:name there"``. The
    first use of a name binds every export of its submodule at once: importing a submodule
    binds the package's attribute of the submodule's name, which must never stand in for an
    export of that name."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        sub = where.partition(":")[0]
        module = importlib.import_module(f"{package}.{sub}")
        for export, w in exports.items():
            w_sub, _, attr = w.partition(":")
            if w_sub == sub:
                namespace[export] = getattr(module, attr or export)
        return namespace[name]

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
