"""Entry point: builds the typer app from one module per command.

Every library error becomes one line on stderr and its exit code (AutoprecError.exit_code:
1 check failed / nothing feasible, 2 bad input); anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import sys

import typer

from autoprec import cli
from autoprec.errors import AutoprecError

app = typer.Typer(
    name="autoprec",
    help="Automatic per-layer precision tuning for PyTorch models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Each command lives in its own module (autoprec/cli/<name>.py) exposing `register(app)`.
    # Once per process: main() called again (tests, embedding) must not add every command a
    # second time (typer rebuilds all registered commands on each call).
    if app.registered_commands:
        return
    from autoprec.cli import commands

    for register in commands.REGISTRY:
        register(app)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the process exit code."""
    # Kept in the package module: ``python -m autoprec.cli.main`` runs this file as
    # __main__, a different module object from autoprec.cli.main.
    cli.current_argv[:] = list(sys.argv[1:] if argv is None else argv)
    _register()
    try:
        # Non-standalone typer *returns* the code of a typer.Exit (and 130 for Ctrl-C).
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc != 0:
            if rc == 130:
                print("autoprec: interrupted", file=sys.stderr)
            sys.exit(rc)
    except AutoprecError as err:
        print(f"autoprec: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except typer.Exit as ex:
        sys.exit(ex.exit_code)
    except KeyboardInterrupt:
        print("autoprec: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        # typer bundles its own copy of click: match its usage errors by shape, not class.
        if callable(getattr(err, "format_message", None)) and getattr(err, "exit_code", 0) == 2:
            print(f"autoprec: error: {err.format_message()}", file=sys.stderr)
            sys.exit(2)
        if type(err).__name__ == "Abort":
            print("autoprec: interrupted", file=sys.stderr)
            sys.exit(130)
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
