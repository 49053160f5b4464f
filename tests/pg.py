"""A real, throwaway PostgreSQL server for tests and experiments (never a mock).

``postgres_server()`` runs ``initdb`` into a temporary directory, starts the server on a
free loopback port with its socket in that directory, and stops and removes it on exit.
PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user
(``runuser -u postgres``) and the directory is handed to that user. Durability is off
(``fsync``, ``synchronous_commit``, ``full_page_writes``): the data dies with the test.

In pytest, use the fixtures (import them into the test module)::

    from tests.pg import pg_server, pg_url  # noqa: F401

    def test_x(pg_url): ...            # a fresh, empty database per test

Outside pytest (``benchmarks/workers_scaling.py``)::

    with postgres_server() as pg:
        url = pg.create_database("bench")   # postgresql://postgres@127.0.0.1:PORT/bench

Tests skip, with the reason, only where ``initdb`` cannot be found.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SUPERUSER = "postgres"


def find_bin(name: str) -> str | None:
    """``initdb``/``pg_ctl`` on PATH, else from Debian's versioned directory."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def unavailable_reason() -> str | None:
    """Why a server cannot be started here, or None when it can."""
    for name in ("initdb", "pg_ctl"):
        if find_bin(name) is None:
            return f"PostgreSQL's {name} not found (PATH, /usr/lib/postgresql/*/bin)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SUPERUSER)
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server"
        if shutil.which("runuser") is None:
            return "running as root and runuser is not found"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_server_user(cmd: list[str]) -> list[str]:
    # The server refuses root; as any other user it runs as that user.
    return ["runuser", "-u", SUPERUSER, "--", *cmd] if os.geteuid() == 0 else cmd


@dataclass
class PostgresServer:
    """A running server: ``url(db)`` and ``create_database(name)``."""

    port: int
    socket_dir: Path
    user: str

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create database ``name`` (dropping one of that name first); returns its URL."""
        import psycopg2

        conn = psycopg2.connect(self.url(), connect_timeout=5)
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.url(name)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a throwaway server; stop it and delete its files on exit (even on error)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    initdb, pg_ctl = find_bin("initdb"), find_bin("pg_ctl")
    assert initdb is not None and pg_ctl is not None
    root = Path(tempfile.mkdtemp(prefix="autoprec-pg-"))
    data = root / "data"
    log = root / "server.log"
    if os.geteuid() == 0:
        entry = pwd.getpwnam(SUPERUSER)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    user = SUPERUSER if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    started = False
    try:
        subprocess.run(
            _as_server_user(
                [initdb, "-D", str(data), "-A", "trust", "-U", user, "--no-sync", "-E", "UTF8"]
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        port = _free_port()
        options = (
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        subprocess.run(
            _as_server_user(
                [pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start"]
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        started = True
        yield PostgresServer(port=port, socket_dir=root, user=user)
    except subprocess.CalledProcessError as err:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(
            f"PostgreSQL failed: {' '.join(err.cmd)}\n{err.stdout}{err.stderr}{tail}"
        ) from err
    finally:
        if started:
            subprocess.run(
                _as_server_user([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"]),
                capture_output=True,
            )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One server for the whole session (initdb + start take a couple of seconds)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as server:
        yield server


@pytest.fixture
def pg_url(pg_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    """URL of a fresh, empty database for one test."""
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:50].lower()
    return pg_server.create_database(name)
