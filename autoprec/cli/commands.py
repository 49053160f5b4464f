"""Which command modules make up the CLI (each exposes ``register(app)``)."""

from __future__ import annotations

from collections.abc import Callable

import typer

from autoprec.cli import (
    check_cmd,
    env_cmd,
    export_cmds,
    graph_cmd,
    policy_cmds,
    probe_cmd,
    tune_cmd,
)

REGISTRY: list[Callable[[typer.Typer], None]] = [
    graph_cmd.register,
    env_cmd.register,
    tune_cmd.register,
    probe_cmd.register,
    policy_cmds.register,
    check_cmd.register,
    export_cmds.register,
]
