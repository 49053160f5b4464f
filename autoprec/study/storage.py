"""Where studies live: ``--storage`` URLs, opening them, and joining a study safely.

Accepted URLs (docs/overview.md, "Studies"):

==========================  ================================================================
``None``                    a SQLite file at ``default_path`` (beside the output)
``sqlite:///PATH``          one process at a time (SQLite locks under parallel writers,
                            optuna#820); heartbeats work but no other worker shares it
``postgresql://…``          many processes on many machines; heartbeats: the trial of a
                            killed worker is failed once it is ``grace_period`` s stale and
                            re-queued (WAITING, ``system_attrs['failed_trial']``) up to
                            ``max_retry`` times. Also ``postgresql+psycopg2://``,
                            ``postgresql+psycopg://`` (psycopg 3) and ``postgres://``; a bare
                            scheme uses psycopg2 where it is installed.
``journal:PATH``            Optuna's journal file: several processes on one machine, no
                            server, no heartbeats (a killed worker's trial stays RUNNING)
``memory`` / ``:memory:``   in-memory, this process only (returns None)
==========================  ================================================================

Heartbeats only run inside ``Study.optimize`` (Optuna starts the thread there); stale
trials are failed when a worker *starts* a trial. ``reap_stale_trials`` does the same
sweep on demand (at the end of a run, or before ``ask`` in an ask/tell loop, which gets no
heartbeats at all).

Every error here is an :class:`~autoprec.errors.InputError` (exit 2) whose one line names
the URL, with any password replaced by ``***``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from autoprec.errors import AutoprecError, InputError, OutputError
from autoprec.io.paths import check_sqlite_url, sqlite_file

#: Seconds between heartbeats of a running trial (RDB storages only).
HEARTBEAT_INTERVAL = 10
#: Seconds without a heartbeat after which a RUNNING trial is failed and re-queued.
GRACE_PERIOD = 30
#: How often one trial is re-queued after its worker died.
MAX_RETRY = 2
#: Seconds to wait for a database server before giving up (a wrong host must fail fast).
CONNECT_TIMEOUT = 5

FINGERPRINT_ATTR = "fingerprint"
#: How long a joiner waits for the creator to record the fingerprint (normally a few ms
#: after creating the study); only an empty study without one waits this long.
FINGERPRINT_WAIT_S = 3.0

_RULE = "use sqlite:///PATH, postgresql://USER[:PASSWORD]@HOST[:PORT]/DB, journal:PATH or memory"
_PG_SCHEMES = ("postgresql", "postgresql+psycopg2", "postgresql+psycopg", "postgres")
_PASSWORD = re.compile(r"(?P<head>://[^:/@\s]*:)[^@/\s]*(?P<tail>@)")


def describe_storage(url: str | None, default_path: Path | None = None) -> str:
    """The storage as a string for logs and tags, with any password hidden (``***``)."""
    if url is None:
        return f"sqlite:///{default_path}" if default_path is not None else "sqlite (default)"
    return _PASSWORD.sub(r"\g<head>***\g<tail>", url)


def is_parallel_safe(url: str | None) -> bool:
    """Whether several worker processes may share this storage (PostgreSQL or journal)."""
    if url is None:
        return False
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return scheme in _PG_SCHEMES or url.startswith("journal:")


def open_storage(
    url: str | None,
    default_path: Path,
    *,
    heartbeat_interval: int = HEARTBEAT_INTERVAL,
    grace_period: int = GRACE_PERIOD,
    max_retry: int = MAX_RETRY,
    connect_timeout: int = CONNECT_TIMEOUT,
) -> BaseStorage | None:
    """Open (and for RDB, reach and initialise) the storage ``url`` names; see module doc.

    Returns None for in-memory. Raises InputError naming the URL for an unknown scheme, a
    missing driver, an unreachable server or a path that cannot hold the file.
    """
    if url is None:
        default_path = Path(default_path)
        try:
            default_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot create the study folder {default_path.parent}: "
                             f"{err.strerror or err}") from None
        if default_path.is_file() and not _looks_like_sqlite(default_path):
            raise InputError(f"{default_path}: is not a SQLite database (the default study "
                             "storage); move it away or give --storage")
        return _open_rdb(
            f"sqlite:///{default_path}",
            {},
            heartbeat_interval,
            grace_period,
            max_retry,
            shown=describe_storage(None, default_path),
        )
    check_storage_url(url)
    shown = describe_storage(url)
    if url in ("memory", ":memory:"):
        return None
    if url.startswith("journal:"):
        return _open_journal(url[len("journal:") :], shown)
    scheme, rest = url.split("://", 1)
    if scheme.lower() == "sqlite":
        return _open_rdb(url, {}, heartbeat_interval, grace_period, max_retry, shown=shown)
    if scheme.lower() in ("postgresql", "postgres"):
        url = f"{_default_pg_scheme()}://{rest}"
    engine_kwargs: dict[str, Any] = {
        "pool_pre_ping": True,  # a connection dropped by the server is replaced, not an error
        "connect_args": {"connect_timeout": connect_timeout},
    }
    return _open_rdb(url, engine_kwargs, heartbeat_interval, grace_period, max_retry,
                     shown=shown)


def check_storage_url(url: str) -> None:
    """What can be told about ``--storage URL`` without connecting: the scheme, and for a
    file (SQLite, journal) that its folder exists and that an existing file is of the
    right kind. InputError (exit 2) naming the URL otherwise. ``open_storage`` runs it
    first; ``tuning.config.TuneConfig.validated`` runs it before any work."""
    if not isinstance(url, str) or not url.strip():
        raise InputError(f"--storage: must be a storage URL; {_RULE}")
    shown = describe_storage(url)
    if url in ("memory", ":memory:"):
        return
    if url.startswith("journal:"):
        _check_journal_path(url[len("journal:") :], shown)
        return
    if "://" not in url:
        raise InputError(f"--storage '{shown}': not a storage URL; {_RULE}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "sqlite":
        _check_sqlite_path(rest, shown)
    elif scheme not in _PG_SCHEMES:
        raise InputError(f"--storage '{shown}': unsupported scheme '{scheme}'; {_RULE}")
    else:
        _check_pg_url(url, shown)


def _check_pg_url(url: str, shown: str) -> None:
    """A PostgreSQL URL parses (port a number in [1, 65535], a database named) before any
    work: connecting is left to the run, a typo'd URL is not."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
        port = parsed.port
    except Exception as err:  # SQLAlchemy: ArgumentError / ValueError on a bad port
        why = f"the port is not a number ({err})" if isinstance(err, ValueError) else str(err)
        raise InputError(f"--storage '{shown}': not a valid PostgreSQL URL: {why[:200]}; "
                         f"{_RULE}") from None
    if port is not None and not 1 <= port <= 65535:
        raise InputError(f"--storage '{shown}': port {port} is not in [1, 65535]")
    if not parsed.database:
        raise InputError(f"--storage '{shown}': no database named (postgresql://USER@HOST/DB)")


def _default_pg_scheme() -> str:
    # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; autoprec's extra installs
    # psycopg2 ('autoprec[postgres]'), so a bare URL uses psycopg2 when it is there.
    import importlib.util

    return "postgresql+psycopg2" if importlib.util.find_spec("psycopg2") else "postgresql"


def _check_sqlite_path(rest: str, shown: str) -> None:
    # sqlite:///rel.db -> rest '/rel.db'; sqlite:////abs.db -> rest '//abs.db'
    if not rest.startswith("/"):
        raise InputError(f"--storage '{shown}': a SQLite URL has three slashes: sqlite:///PATH")
    check_sqlite_url("sqlite://" + rest, "--storage", shown)  # the same rule as --mlflow-uri
    file = sqlite_file("sqlite://" + rest)
    if file is not None and file.is_file() and not _looks_like_sqlite(file):
        raise InputError(f"--storage '{shown}': '{file}' is not a SQLite database; point "
                         "sqlite:/// at a new file or an existing study database")


#: The first 16 bytes of every SQLite 3 database file (sqlite.org/fileformat.html).
_SQLITE_MAGIC = b"SQLite format 3\x00"


def _looks_like_sqlite(file: Path) -> bool:
    with file.open("rb") as fh:
        head = fh.read(len(_SQLITE_MAGIC))
    return head in (b"", _SQLITE_MAGIC)  # an empty file is a new database


def _check_journal_path(path: str, shown: str) -> None:
    if not path:
        raise InputError(f"--storage '{shown}': journal needs a file: journal:PATH")
    file = Path(path)
    if file.is_dir():
        raise InputError(f"--storage '{shown}': '{file}' is a directory, not a journal file")
    if not file.parent.is_dir():
        raise InputError(f"--storage '{shown}': directory '{file.parent}' does not exist")
    if file.exists() and not file.is_file():
        raise InputError(f"--storage '{shown}': '{file}' is not a regular file")
    if file.is_file() and not _looks_like_journal(file):
        raise InputError(
            f"--storage '{shown}': '{file}' is not an Optuna journal (its first line is not "
            "a journal record); point journal: at a new file or an existing journal"
        )


def _open_journal(path: str, shown: str) -> JournalStorage:
    _check_journal_path(path, shown)
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except (OSError, ValueError) as err:  # ValueError: a file that is not a journal (JSON)
        raise InputError(
            f"--storage '{shown}': not a usable journal file ({_first_line(err)})"
        ) from err


def _looks_like_journal(file: Path) -> bool:
    # Optuna skips an undecodable *last* line (a write cut short), so a SQLite file or a
    # typo'd path to some text file would silently become an empty study; check line one.
    with file.open("rb") as fh:
        first = fh.readline(1 << 16)
    if not first:
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def _open_rdb(
    url: str,
    engine_kwargs: dict[str, Any],
    heartbeat_interval: int,
    grace_period: int,
    max_retry: int,
    *,
    shown: str,
) -> RDBStorage:
    import sqlalchemy.exc

    last: Exception | None = None
    # Several workers initialising one empty database race on CREATE TABLE: PostgreSQL
    # raises a unique violation on pg_type, SQLite "table … already exists" or "database is
    # locked"; the loser retries and finds the tables.
    for attempt in range(_INIT_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(
                    url,
                    engine_kwargs=dict(engine_kwargs),
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(
                        max_retry=max_retry
                    ),
                )
        except ImportError as err:
            driver = "psycopg2" if url.startswith("postgresql") else "the database driver"
            raise InputError(
                f"--storage '{shown}': {driver} is not installed (pip install 'autoprec[postgres]')"
            ) from err
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as err:
            last = err
            time.sleep(0.2 * (attempt + 1))
        except sqlalchemy.exc.OperationalError as err:
            if not _is_init_race(err):
                full_or_read_only = storage_failure(err, shown)
                if full_or_read_only is not None:
                    raise full_or_read_only from err
                raise InputError(
                    f"--storage '{shown}': cannot open the database "
                    f"({_first_line(err.orig or err)})"
                ) from err
            last = err
            time.sleep(0.2 * (attempt + 1))
        except sqlalchemy.exc.DatabaseError as err:  # e.g. "file is not a database"
            raise InputError(
                f"--storage '{shown}': not a usable database ({_first_line(err.orig or err)})"
            ) from err
        except sqlalchemy.exc.ArgumentError as err:
            raise InputError(f"--storage '{shown}': {_first_line(err)}; {_RULE}") from err
    raise InputError(f"--storage '{shown}': cannot initialise the database ({_first_line(last)})")


#: Tries to open a database that other workers are initialising at the same moment.
_INIT_ATTEMPTS = 6


def _is_init_race(err: BaseException) -> bool:
    text = str(getattr(err, "orig", None) or err).lower()
    return "already exists" in text or "database is locked" in text


def _first_line(err: BaseException | None) -> str:
    text = str(err).strip().splitlines()
    return _PASSWORD.sub(r"\g<head>***\g<tail>", text[0]) if text else type(err).__name__


def join_study(
    storage: BaseStorage | None,
    study_name: str,
    *,
    fingerprint: str,
    directions: Sequence[str],
    sampler: optuna.samplers.BaseSampler | None = None,
    load_if_exists: bool = True,
    shown: str | None = None,
) -> optuna.Study:
    """Create study ``study_name`` or join it, refusing one made for another model.

    The creator records ``fingerprint`` as the study's user attribute; a joiner must
    carry the same one and the same ``directions`` ("minimize"/"maximize"), else
    InputError (exit 2). With ``load_if_exists=False`` an existing study is an error.
    ``shown`` names the storage in messages (``describe_storage``).
    """
    where = shown or _storage_name(storage)
    dirs = [d.lower() for d in directions]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            study = optuna.create_study(
                storage=storage, sampler=sampler, study_name=study_name, directions=dirs
            )
        except optuna.exceptions.DuplicatedStudyError:
            if not load_if_exists:
                raise InputError(
                    f"study '{study_name}' already exists in {where}; "
                    "choose another --study-name or join it"
                ) from None
            study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler)
        else:
            study.set_user_attr(FINGERPRINT_ATTR, fingerprint)
            return study
    theirs = [d.name.lower() for d in study.directions]
    if theirs != dirs:
        raise InputError(
            f"study '{study_name}' in {where} optimises {theirs}, not {dirs}; "
            "use another --study-name"
        )
    recorded = _wait_for_fingerprint(study)
    if recorded is None:
        if study.get_trials(deepcopy=False):
            raise InputError(
                f"study '{study_name}' in {where} has trials but no model fingerprint "
                "(not made by autoprec); use another --study-name"
            )
        study.set_user_attr(FINGERPRINT_ATTR, fingerprint)  # an empty foreign study: adopt it
    elif recorded != fingerprint:
        raise InputError(
            f"study '{study_name}' in {where} belongs to a different model "
            f"(fingerprint {_short(recorded)} != {_short(fingerprint)})"
        )
    return study


def _wait_for_fingerprint(study: optuna.Study) -> str | None:
    # The creator sets the attribute just after creating the study; a worker that joins in
    # between would otherwise see a study without one.
    deadline = time.monotonic() + FINGERPRINT_WAIT_S
    while True:
        value = study.user_attrs.get(FINGERPRINT_ATTR)
        if value is not None or time.monotonic() > deadline:
            return None if value is None else str(value)
        if study.get_trials(deepcopy=False):
            return None
        time.sleep(0.1)


def _short(fingerprint: str) -> str:
    algo, _, digest = fingerprint.partition(":")
    return f"{algo}:{digest[:12]}…" if digest else fingerprint[:19] + "…"


def _storage_name(storage: BaseStorage | None) -> str:
    if storage is None:
        return "memory"
    url = getattr(storage, "url", None) or getattr(getattr(storage, "_backend", None), "url", None)
    if isinstance(url, str):
        return describe_storage(url)
    backend = getattr(storage, "_backend", None)
    path = getattr(backend, "_file_path", None)
    return f"journal:{path}" if path else type(storage).__name__


def storage_failure(err: BaseException, shown: str) -> OutputError | None:
    """A study write that failed for a reason the user can fix — a read-only database or
    file system, a full disk — as one line naming the storage (exit 2); None otherwise.

    Optuna wraps the cause (StorageInternalError, or its own ``AssertionError: Should not
    reach.`` when a trial's final state could not be written): the chain is searched."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        orig = getattr(e, "orig", None)
        text = str(orig or e).lower()
        code = getattr(orig, "errno", None) or getattr(e, "errno", None)
        if code == errno.ENOSPC or "disk is full" in text or "no space left" in text:
            return OutputError(f"--storage '{shown}': cannot write the study: no space left "
                               "on the device; the trials finished before are kept (free "
                               "space, then --resume goes on from them)")
        if (code == errno.EROFS or "readonly database" in text or "read-only" in text
                or "read only" in text):
            return OutputError(f"--storage '{shown}': cannot write the study: the database "
                               "is read-only; copy it somewhere writable or give another "
                               "--storage")
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def storage_errors(shown: str) -> Iterator[None]:
    """Turn a read-only or full study storage into one line (``storage_failure``)."""
    try:
        yield
    except AutoprecError:
        raise
    except Exception as err:
        mapped = storage_failure(err, shown)
        if mapped is None:
            raise
        raise mapped from err


_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def count_finished(study: optuna.Study) -> int:
    """Trials that count towards ``--resume N``: COMPLETE plus PRUNED."""
    return len(study.get_trials(deepcopy=False, states=_FINISHED))


def reap_stale_trials(study: optuna.Study) -> None:
    """Fail RUNNING trials whose heartbeat is older than the grace period, re-queueing them.

    Optuna does this only when a worker starts a trial; call it when a run ends (so a
    dead worker's trial does not stay RUNNING) or before each ``ask`` in an ask/tell loop.
    No-op without heartbeats (journal, in-memory).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
