"""Entry point: builds the typer app from one module per command.

Every library error becomes one line on stderr and its exit code (AutoprecError.exit_code:
1 check failed / nothing feasible, 2 bad input); anything else is a bug and keeps its
traceback. Library warnings are one ``autoprec: warning: …`` line each. SIGTERM is
treated like Ctrl-C (``tune`` finishes the running trial, then exits 130).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Annotated, Any

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


def _print_version(value: bool) -> None:
    if value:
        from autoprec import __version__

        print(f"autoprec {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print autoprec's version and exit.")] = False,
) -> None:
    """Automatic per-layer precision tuning for PyTorch models."""


def _register() -> None:
    # Each command lives in its own module (autoprec/cli/<name>.py) exposing `register(app)`.
    # Once per process: main() called again (tests, embedding) must not add every command a
    # second time (typer rebuilds all registered commands on each call).
    if app.registered_commands:
        return
    from autoprec.cli import commands

    for register in commands.REGISTRY:
        register(app)


#: The longest error line printed; messages quote values briefly, this is the last guard.
MAX_MESSAGE = 2000


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 20] + " … (cut short)"


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    text = str(message).strip().splitlines()
    print(f"autoprec: warning: {_bounded(text[0]) if text else category.__name__}",
          file=sys.stderr)


@contextlib.contextmanager
def _cli_signals_and_warnings() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (as Ctrl-C does); warnings print as one line."""
    with warnings.catch_warnings():
        original = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, UserWarning):
                _show_warning(message, category, *args, **kwargs)
            else:  # DeprecationWarning & co. from libraries: their usual form
                original(message, category, *args, **kwargs)

        warnings.showwarning = show
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the process exit code."""
    from autoprec.tuning.memory import map_large_allocations

    map_large_allocations()  # freed tensors go back to the OS (autoprec.tuning.memory)
    with _cli_signals_and_warnings():
        _main(argv)
    return 0  # not reached: _main always exits


def _main(argv: list[str] | None) -> None:
    # Kept in the package module: ``python -m autoprec.cli.main`` runs this file as
    # __main__, a different module object from autoprec.cli.main.
    cli.current_argv[:] = list(sys.argv[1:] if argv is None else argv)
    _register()
    if not cli.current_argv:  # typer prints the help, then raises an empty usage error
        app(args=["--help"], standalone_mode=False)
        print("autoprec: error: missing command (one of those above, e.g. autoprec tune "
              "model.py)", file=sys.stderr)
        sys.exit(2)
    try:
        # Non-standalone typer *returns* the code of a typer.Exit (and 130 for Ctrl-C).
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc != 0:
            if rc == 130:
                print("autoprec: interrupted", file=sys.stderr)
            sys.exit(rc)
    except AutoprecError as err:
        print(f"autoprec: error: {_bounded(str(err))}", file=sys.stderr)
        sys.exit(err.exit_code)
    except typer.Exit as ex:
        sys.exit(ex.exit_code)
    except KeyboardInterrupt:
        print("autoprec: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        # typer bundles its own copy of click: match its usage errors by shape, not class.
        if callable(getattr(err, "format_message", None)) and getattr(err, "exit_code", 0) == 2:
            message = err.format_message().strip()
            if message:  # empty: the help was printed instead (a group without a command)
                print(f"autoprec: error: {message}", file=sys.stderr)
            sys.exit(2)
        if type(err).__name__ == "Abort":
            print("autoprec: interrupted", file=sys.stderr)
            sys.exit(130)
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
