"""Study names and probe cache keys survive moves of autoprec's own code: a function
autoprec provides is hashed under its module's ``HASHED_AS`` name (issue 48)."""

from __future__ import annotations

import importlib
import importlib.util

from autoprec.probe.cache import function_hash
from autoprec.workload.hashing import HASHED_AS, function_code
from autoprec.workload.loading import default_forward


def test_a_default_function_is_hashed_under_its_first_name() -> None:
    assert function_code(default_forward).splitlines()[0] == "autoprec.loading.default_forward"
    # the value main had before the move (2290036): the trap and mixed8 examples' studies
    assert function_hash(default_forward) == "b74e6868a1cf0d3d"


def test_every_moved_module_exists_and_its_old_name_does_not() -> None:
    for now, before in HASHED_AS.items():
        assert importlib.import_module(now).__name__ == now
        assert importlib.util.find_spec(before) is None, f"{before} is back: a duplicate"
