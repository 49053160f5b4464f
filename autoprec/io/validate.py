"""Argument checks that run before any work: a bad value is exit 2 in milliseconds, not
after minutes of probing (and never after a study database was created).

Each check raises :class:`~autoprec.errors.InputError` stating the rule and the value,
``--seed: must be an integer in [0, 4294967295], got -5``. The CLI and the Python API
(``tune``) call the same functions; the flag names are the CLI's, and the Python API
rewrites them as its keyword arguments (``keyword_errors``).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autoprec.errors import InputError
from autoprec.io.fileio import brief

#: numpy's RandomState (Optuna's samplers) takes seeds in [0, 2**32 - 1].
MAX_SEED = 2**32 - 1
#: The largest deployment batch size (leading dimension) the cost model prices; a bigger
#: number is a typo (a token count?) and 10**400 would overflow its float arithmetic.
MAX_BATCH_SIZE = 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_seed(seed: Any, flag: str = "--seed", workers: int = 1) -> int:
    """An integer in [0, MAX_SEED]; with N workers (seeds seed..seed+N-1) all of them."""
    top = MAX_SEED - max(workers - 1, 0)
    if not _is_int(seed) or not 0 <= seed <= top:
        extra = f" ({workers} workers use seed .. seed+{workers - 1})" if workers > 1 else ""
        raise InputError(f"{flag}: must be an integer in [0, {top}]{extra}, got {brief(seed)}")
    return seed


def check_batch_size(value: Any, flag: str = "--batch-size") -> int | None:
    """None, or an integer in [1, MAX_BATCH_SIZE]."""
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_BATCH_SIZE:
        raise InputError(f"{flag}: must be an integer in [1, {MAX_BATCH_SIZE}], "
                         f"got {brief(value)}")
    return value


def check_seconds(value: Any, flag: str, allow_zero: bool = False) -> float | None:
    """None, or a finite number of seconds > 0 (>= 0 with ``allow_zero``: 0 = no limit).

    ``nan`` and ``inf`` are refused: neither is a time limit (leave the option out)."""
    if value is None:
        return None
    ok = is_number(value) and math.isfinite(value) and (value >= 0 if allow_zero
                                                         else value > 0)
    if not ok:
        rule = ">= 0 (0: no limit)" if allow_zero else "> 0"
        raise InputError(f"{flag}: must be a finite number of seconds {rule}, "
                         f"got {brief(value)}")
    return float(value)


def check_count(value: Any, flag: str, optional: bool = False) -> int | None:
    """An integer >= 1 (None allowed with ``optional``)."""
    if value is None and optional:
        return None
    if not _is_int(value):
        raise InputError(f"{flag}: must be an integer, got {brief(value)}")
    if value < 1:
        raise InputError(f"{flag}: must be >= 1, got {value}")
    return value


#: The error budget when nothing else says (DESIGN.md: ``--max-error 0.01``): tune's and
#: check's one default.
DEFAULT_MAX_ERROR = 0.01


def check_budget(max_error: Any, max_drop: Any) -> None:
    """At most one budget, a finite number >= 0."""
    if max_error is not None and max_drop is not None:
        raise InputError("give --max-error or --max-drop, not both")
    for flag, value in (("--max-error", max_error), ("--max-drop", max_drop)):
        if value is None:
            continue
        if not (is_number(value) and math.isfinite(value)):
            raise InputError(f"{flag}: must be a finite number, got {brief(value)}")
        if value < 0:
            raise InputError(f"{flag}: must be >= 0, got {value}")


def check_out_not_input(out: Path, *, model: Any = None, storage: Any = None,
                        mlflow_uri: Any = None) -> None:
    """tune's ``--out`` is not model.py, the study's SQLite / journal file or the MLflow
    database: OutputError (exit 2) instead of overwriting one of them with the policy."""
    from autoprec.io.paths import check_not_an_input, sqlite_file, storage_file

    check_not_an_input(out, {
        "the model file": Path(model) if isinstance(model, (str, Path)) else None,
        "the --storage study file": storage_file(storage),
        "the --mlflow-uri database": (sqlite_file(mlflow_uri) if isinstance(mlflow_uri, str)
                                      else None),
    })


#: Command-line flags whose keyword argument is not the flag's name with "_" for "-".
_KEYWORD_OF = {"lock": "locked", "memory-limit": "memory_limit_gb", "no-measure": "measure=False",
               "json": "", "quiet": "progress=False"}
#: Boolean flags: the keyword is written ``name=True``.
_SWITCHES = {"resume", "pareto", "train-aware", "compile", "force", "measure", "no-track"}
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def as_keywords(message: str) -> str:
    """``message`` with each ``--flag`` written as the Python keyword argument it stands
    for (``--max-error`` -> ``max_error``, ``--force`` -> ``force=True``): what a Python
    caller of ``tune``, ``check`` or ``evaluate`` gave."""
    def keyword(m: re.Match[str]) -> str:
        flag = m.group(1)
        if flag in _KEYWORD_OF:
            return _KEYWORD_OF[flag] or m.group(0)
        name = flag.replace("-", "_")
        return f"{name}=True" if flag in _SWITCHES else name

    return _FLAG.sub(keyword, message)


@contextlib.contextmanager
def keyword_errors(enabled: bool = True) -> Iterator[None]:
    """An ``InputError`` raised inside, its message ``as_keywords`` (when ``enabled``): the
    stages name the CLI's flags; a Python caller reads the names of its own arguments."""
    try:
        yield
    except InputError as err:
        if not enabled:
            raise
        text = as_keywords(str(err))
        if text == str(err):
            raise
        try:
            again = type(err)(text)
        except TypeError:  # a subclass with another constructor
            again = InputError(text)
        raise again.with_traceback(err.__traceback__) from err.__cause__


__all__ = ["DEFAULT_MAX_ERROR", "MAX_BATCH_SIZE", "MAX_SEED", "as_keywords", "keyword_errors", "check_batch_size", "check_budget", "check_count",
           "check_out_not_input", "check_seconds", "check_seed", "is_number"]
