"""Optional dependencies: which extra of ``pip install 'autoprec[…]'`` brings a module.

The core install loads, applies, checks and evaluates policies and runs the search; what
only some users need is an extra (pyproject.toml): ``mlflow`` (tracking, on by default in
``autoprec tune``, and the plots logged with it), ``postgres`` (studies shared by many
machines), ``fp8`` (Transformer Engine), ``train-fp8`` (torchao's float8 training). A missing one is bad input (exit 2) in one line
that names the extra to install — never an ImportError traceback.
"""

from __future__ import annotations

import importlib.util

from autoprec.errors import InputError

#: module -> the extra that installs it.
EXTRAS: dict[str, str] = {
    "mlflow": "mlflow",
    "matplotlib": "mlflow",
    "requests": "mlflow",
    "psycopg2": "postgres",
    "transformer_engine": "fp8",
    "compressed_tensors": "export",
    "torchao": "train-fp8",
}


class MissingExtra(InputError):
    """An optional dependency is not installed; the message names the extra (exit 2)."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        return False


def require(module: str, needed_for: str, otherwise: str | None = None) -> None:
    """Raise MissingExtra when ``module`` is not installed, e.g.

    ``MLflow tracking needs mlflow, which is not installed: pip install 'autoprec[mlflow]'
    (or --no-track)``.
    """
    if installed(module):
        return
    extra = EXTRAS.get(module)
    how = f"pip install 'autoprec[{extra}]'" if extra else f"pip install {module}"
    alt = f" (or {otherwise})" if otherwise else ""
    raise MissingExtra(f"{needed_for} needs {module}, which is not installed: {how}{alt}")


__all__ = ["EXTRAS", "MissingExtra", "installed", "require"]
