"""``main()`` called many times in one process (tests, embedding) registers each command
once: typer rebuilds every registered command on each call, so duplicates made every
later call slower (0.05 s -> 0.5 s per call over this suite)."""

from __future__ import annotations

import pytest

from autoprec.cli.main import app, main


def test_commands_are_registered_once() -> None:
    for _ in range(3):
        with pytest.raises(SystemExit):
            main(["env", "--help"])
    names = [c.name for c in app.registered_commands]
    assert len(names) == len(set(names)) and "tune" in names and "show" in names
