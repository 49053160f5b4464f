"""Files in and out: read user files without hanging, write outputs atomically.

Reading (``read_regular``): only a regular file is read, and at most ``limit`` bytes of it —
a FIFO would block the read forever and ``/dev/zero`` never ends. The file is opened
non-blocking and checked with ``fstat`` on the open descriptor, so what is checked is what
is read.

Writing (``atomic_write``): a temp file in the destination's folder, fsync, ``os.replace``,
then an fsync of the folder. A reader never sees a half-written file and a crash or a full
disk leaves the previous file intact. The destination must be a regular file or absent: a
FIFO, a device (``/dev/null``) or a socket is refused, never replaced by a file. A symlink
is followed: the file it points to is replaced and the link stays a link.

Every failure is an :class:`~autoprec.errors.InputError` subclass (exit 2) with one line
naming the path. ``brief`` bounds the values such lines quote.
"""

from __future__ import annotations

import contextlib
import errno
import os
import reprlib
import stat
import tempfile
from pathlib import Path
from typing import Any

from autoprec.errors import InputError, OutputError

MiB = 1 << 20


class _Brief(reprlib.Repr):
    """reprlib with room for a path or a precision name, and no huge-int expansion."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = 80
        self.maxother = 80
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 4
        self.maxlevel = 2

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr() of a 5000-digit int raises (int_max_str_digits)
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"
        return repr(x)


_BRIEF = _Brief()


def brief(value: Any) -> str:
    """A repr for error messages, at most about 100 characters whatever ``value`` is."""
    try:
        return _BRIEF.repr(value)
    except Exception:  # a user object whose __repr__ raises
        return f"<{type(value).__name__}>"


def file_kind(mode: int) -> str:
    """'a FIFO', 'a character device', … for a stat mode that is not a regular file."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_regular(path: str | Path, limit: int, what: str = "file",
                 error: type[InputError] = InputError) -> bytes:
    """The bytes of the regular file ``path``; ``error`` (exit 2) naming it otherwise.

    Refuses a missing file, a directory, a FIFO, a device, and a file over ``limit`` bytes.
    """
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{path}: is a directory, expected a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: is {file_kind(st.st_mode)}, not a regular file; "
                        f"give the {what} itself")
        if st.st_size > limit:
            raise error(f"{path}: {st.st_size} bytes is larger than a {what} may be "
                        f"({limit // MiB} MiB)")
        chunks, total = [], 0
        while True:  # the size can change under us: read at most limit + 1 bytes
            chunk = os.read(fd, min(1 << 16, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise error(f"{path}: larger than a {what} may be ({limit // MiB} MiB)")
        return b"".join(chunks)
    except OSError as err:
        raise error(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    finally:
        os.close(fd)


def write_target(path: str | Path) -> Path:
    """Where a write to ``path`` lands: the path itself, or what a symlink points to.

    OutputError when that exists and is not a regular file (a directory, FIFO, device).
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # absent (check_writable says why)
        return target
    except OSError as err:
        raise OutputError(f"{path}: cannot write there: {err.strerror or err}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: is a directory; give a file path such as "
                          f"{path / 'out.yaml'}")
    if not stat.S_ISREG(st.st_mode):
        via = f" (the symlink points to {target})" if target != path else ""
        raise OutputError(f"{path}: is {file_kind(st.st_mode)}{via}, not a regular file; "
                          "autoprec replaces its output files whole, so it writes only "
                          "regular files: give another path")
    return target


def check_can_write_in(folder: Path, where: str, prefix: str = ".autoprec-") -> None:
    """The nearest existing folder on the way to ``folder`` is a folder that can really be
    written (a temp file made and removed there: read-only file systems and /proc are found
    as well as permissions). OutputError (exit 2) starting with ``where`` otherwise."""
    while not folder.exists() and folder != folder.parent:
        if folder.is_symlink():  # a dangling link on the way
            raise OutputError(f"{where}: {folder} is a symlink to nothing")
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"{where}: {folder} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".check", dir=folder)
    except OSError as err:
        raise OutputError(f"{where}: cannot write in {folder}: {err.strerror or err}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def check_writable(path: str | Path) -> Path:
    """Check, before any long work, that ``atomic_write(path, …)`` can succeed: the target
    is a regular file or absent, and the nearest existing folder on its way is a folder
    that can be written (a temp file is made and removed there: this finds read-only file
    systems and /proc as well as permissions). Creates nothing. Returns the target;
    OutputError (exit 2) naming the problem otherwise."""
    path = Path(path)
    target = write_target(path)
    check_can_write_in(target.parent, f"{path}", prefix=f".{target.name}.")
    return target


def atomic_write(path: str | Path, data: str | bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docs); returns ``path``.

    ``mode``: the new file's permissions (default: the old file's, else rw-r--r--).
    OutputError (exit 2) on any failure, the previous file left as it was.
    """
    path = Path(path)
    target = write_target(path)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    existed = target.exists()
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)  # NotADirectoryError: an OSError
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            # mkstemp makes the file private (0600); outputs are for review and sharing.
            if mode is None:
                mode = target.stat().st_mode & 0o777 if existed else 0o644
            os.fchmod(fd, mode)
            view = memoryview(blob)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        tmp = None
    except OSError as err:
        kept = "; the previous file is unchanged" if existed else ""
        why = err.strerror or str(err)
        if err.errno == errno.ENOSPC:
            why = "no space left on the device"
        raise OutputError(f"{path}: cannot write: {why}{kept}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _fsync_dir(target.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    # The rename is durable once the folder's entry is on disk (POSIX; a no-op elsewhere).
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = ["atomic_write", "brief", "check_writable", "file_kind", "read_regular",
           "write_target"]
