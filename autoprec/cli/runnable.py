"""The commands tune prints (``next: …``) as they can be run from where the user is.

After the README's set-up the venv is not activated: ``autoprec`` and ``mlflow`` are not
on PATH, ``.venv/bin/autoprec`` is. A command is shown by its bare name only when PATH
finds that very file; else by its path (relative to the working folder when inside it).
Derived from how this process was started (``sys.argv[0]``, ``sys.executable``), never
hard-coded; PATH is read here, at the CLI boundary.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

#: What ``python -m`` runs for the CLI (``python -m autoprec`` has no __main__).
CLI_MODULE = "autoprec.cli.main"


def _shown(path: Path) -> str:
    """``path`` as a user can type it here: its bare name when PATH finds this very file
    (not a file it links to: a venv's python links to a system python without autoprec),
    else relative to the working folder when inside it, else absolute."""
    path = Path(os.path.abspath(path))
    found = shutil.which(path.name)
    if found is not None and Path(os.path.abspath(found)) == path:
        return path.name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _python() -> str:
    return _shown(Path(sys.executable)) if sys.executable else "python3"


def autoprec_command() -> str:
    """How to run ``autoprec`` again: the script this process was started as; under
    ``python -m autoprec.cli.main`` that; embedded (pytest, a notebook) the script beside
    the running interpreter, else ``python -m``."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if started is not None and started.name == "autoprec":
        return _shown(started)
    if started is not None and started.name == "main.py" and started.parent.name == "cli":
        return f"{_python()} -m {CLI_MODULE}"
    beside = Path(sys.executable).parent / "autoprec" if sys.executable else None
    if beside is not None and beside.is_file():
        return _shown(beside)
    return f"{_python()} -m {CLI_MODULE}"


def tool_command(name: str) -> str:
    """A console script installed with autoprec's environment (``mlflow``): the one beside
    the ``autoprec`` script this process started as, or beside the running interpreter;
    else the one on PATH, else ``python -m name``."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    dirs = [started.parent] if started is not None and started.name == "autoprec" else []
    dirs += [Path(sys.executable).parent] if sys.executable else []
    for folder in dirs:
        if (folder / name).is_file():
            return _shown(folder / name)
    if shutil.which(name) is not None:
        return name
    return f"{_python()} -m {name}"


__all__ = ["autoprec_command", "tool_command"]
