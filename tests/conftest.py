"""Shared test setup: the repository root on sys.path, so tests import helpers as
``from tests.zoo import bert`` whether pytest is run from the root or elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One PostgreSQL server per test session (started lazily by the first test that needs it).
from tests.pg import pg_server, pg_url  # noqa: E402, F401
