"""Module paths: wrapper prefixes are normalised so policies match wrapped models."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from autoprec.errors import InputError, OutputError
from autoprec.io.fileio import check_can_write_in

#: Prefixes added by wrappers: torch.compile (OptimizedModule), DDP / DataParallel.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside torch.compile / DDP / DataParallel wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        if type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = model.module  # type: ignore[assignment]
            continue
        return model


def normalize_path(path: str) -> str:
    """Strip wrapper prefixes: ``_orig_mod.encoder.0`` -> ``encoder.0``."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if path.startswith(prefix):
                path = path[len(prefix) :]
                changed = True
        if path in ("_orig_mod", "module"):
            return ""
    return path


def covers(rule_path: str, path: str) -> bool:
    """True when a rule on ``rule_path`` applies to module ``path`` (itself or a child)."""
    return rule_path == "" or path == rule_path or path.startswith(rule_path + ".")


def check_out_path(path: Path) -> None:
    """An output file can be written at ``path``: OutputError (exit 2) naming it otherwise.

    The nearest existing folder is really written to (a temp file made and removed): a
    read-only file system or /proc is found here, before any long work. An existing
    ``path`` must be a regular file — a FIFO or a device (``/dev/null``) is refused, never
    replaced; a symlink is followed (the file it points to is replaced). See fileio.
    """
    from autoprec.io.fileio import check_writable

    check_writable(path)


def same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name one file (links and ``..`` followed; either may not exist yet)."""
    try:
        if a.exists() and b.exists():
            return a.samefile(b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def check_not_an_input(out: Path, inputs: dict[str, Path | None], flag: str = "--out") -> None:
    """``out`` is none of the run's own inputs (``{what: path}``): writing the policy there
    would destroy it (model.py turned into YAML, a study database's every trial lost).
    OutputError (exit 2) naming both otherwise."""
    for what, path in inputs.items():
        if path is not None and same_file(Path(out), Path(path)):
            raise OutputError(f"{flag} {out}: is {what} this run reads; write the output to "
                              "another file")


def storage_file(url: str | None) -> Path | None:
    """The file of a ``sqlite:///PATH`` or ``journal:PATH`` storage URL (None otherwise)."""
    if not isinstance(url, str):
        return None
    if url.startswith("journal:"):
        return Path(url[len("journal:"):]) if url[len("journal:"):] else None
    return sqlite_file(url)


def check_dir(path: Path, what: str) -> None:
    """``path`` is, or can be created as, a folder autoprec may write in (a cache, the
    policy folder): OutputError (exit 2) naming it and ``what`` it is for otherwise.
    Creates nothing."""
    from autoprec.io.fileio import check_writable

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path}: exists and is not a directory")
    check_writable(path / ".autoprec-write-check")


def check_out_dir(path: Path, flag: str = "--out") -> Path:
    """``path`` can be an output folder (``autoprec save``'s checkpoint): a folder that
    exists, or that can be created in the nearest existing folder on its way, which is
    really written to (a temp file made and removed: /proc and read-only file systems are
    found here, before any work). An existing file, a FIFO or a device is refused, never
    replaced. OutputError (exit 2) naming ``flag`` and the path otherwise; creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path}: exists and is not a folder (the checkpoint is a "
                          "folder: config.json and *.safetensors); give a folder path")
    check_can_write_in(path, f"{flag} {path}")
    return path


_FRONT = r"\.front\d+"


def remove_stale_fronts(out: Path) -> list[Path]:
    """Remove the Pareto front files of an earlier run beside ``out`` (``STEM.frontK.SUFFIX``,
    what ``tune --pareto`` writes), so that the ones written next are the only ones there.
    Returns what was removed; a file that cannot be removed is OutputError (exit 2)."""
    out = Path(out)
    pattern = re.compile(re.escape(out.stem) + _FRONT + re.escape(out.suffix) + r"\Z")
    removed = []
    folder = out.parent
    if not folder.is_dir():
        return removed
    for entry in sorted(folder.iterdir()):
        if pattern.match(entry.name) and (entry.is_file() or entry.is_symlink()):
            try:
                entry.unlink()
            except FileNotFoundError:
                continue  # another worker removed it
            except OSError as err:
                raise OutputError(f"{entry}: cannot remove this stale Pareto front file: "
                                  f"{err.strerror or err}") from None
            removed.append(entry)
    return removed


def sqlite_file(url: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URL (None: in memory, or not SQLite)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def check_sqlite_url(url: str, flag: str, shown: str | None = None,
                     error: type[InputError] = InputError) -> None:
    """One rule for every SQLite URL a user gives (``--storage``, ``--mlflow-uri``): the
    folder of the database file must exist (autoprec never creates folders a URL names — a
    typo would silently start a new empty store), and the file must not be a folder.
    ``error`` (an InputError, exit 2) naming the flag and the folder otherwise."""
    file = sqlite_file(url)
    if file is None:
        return
    shown = shown or url
    if not file.parent.is_dir():
        raise error(f"{flag} '{shown}': directory '{file.parent}' does not exist")
    if file.is_dir():
        raise error(f"{flag} '{shown}': '{file}' is a directory, not a database file")
    if file.exists() and not file.is_file():
        raise error(f"{flag} '{shown}': '{file}' is not a regular file")
