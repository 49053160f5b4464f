"""A real ``mlflow server`` on loopback for the tracking tests (never a mock).

``mlflow_server(root)`` starts ``mlflow server`` on a free 127.0.0.1 port with a SQLite
backend store and a proxied artifact root inside ``root``, waits for ``/health``, and
stops the whole process group on exit (the server spawns uvicorn workers). MLflow's job
runner (huey consumers for GenAI jobs) is switched off: the tests do not use it and it
costs seconds and processes on a 2-core machine.

Fixtures:

- ``mlflow_server_uri`` (session): one shared server, ~8 s to start.
- ``throwaway_mlflow_server`` (function): a server of its own, for tests that kill it.
- ``experiment``: a fresh experiment name per test, so tests sharing the server never
  see each other's runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

#: MLflow settings the tracker may set for the process; restored after every test.
_MLFLOW_ENV = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT",
)
START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class MlflowServer:
    """A running server: ``uri``; ``stop()`` ends it (idempotent)."""

    uri: str
    root: Path
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        # The server was started in its own session: its pgid is its pid.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)
        # Workers may outlive the parent by a moment; make sure the group is gone.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def log_tail(self, n: int = 30) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    """Start ``mlflow server`` with its store in ``root``; yield it once healthy; stop it."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
        "--artifacts-destination", str(root / "artifacts"),
        "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = root / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", root, process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited ({process.returncode}):\n{server.log_tail()}"
                )
            try:
                if requests.get(f"{server.uri}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server not healthy in {START_TIMEOUT_S:g} s:\n{server.log_tail()}"
                )
            time.sleep(0.25)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server.uri


@pytest.fixture
def throwaway_mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-throwaway")) as server:
        yield server


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    return free_port()


@pytest.fixture
def experiment() -> str:
    return f"autoprec-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def _restore_mlflow_env() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in _MLFLOW_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
