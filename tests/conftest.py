"""Shared test setup: the repository root on sys.path, so tests import helpers as
``from tests.zoo import bert`` whether pytest is run from the root or elsewhere.

``pytest`` runs the quick suite; ``pytest --slow`` (what CI runs) adds the tests marked
``slow``: those that start an MLflow server or tune processes (workers, Ctrl-C and resume),
run the experiment scripts or the README's snippets, check the committed policies of the
transformer and CNN examples, or take more than ~3 s on a 2-core machine. Each one skipped
says so, with the flag that runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The repository root (tests.helpers.ROOT, which cannot be imported before this runs).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# One PostgreSQL server per test session (started lazily by the first test that needs it).
from tests.pg import pg_server, pg_url  # noqa: E402, F401


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (CI does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with pytest --slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
