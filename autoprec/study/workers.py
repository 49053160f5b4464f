"""``--workers N``: run N copies of one ``autoprec`` command on one shared study.

Each child is ``python -m autoprec.cli.main <argv without --workers>``, so each runs its
own ``--trials`` (N workers with ``--trials 10`` add 10 each; with ``--resume`` they
stop together once the study holds the number asked for).

Parallel workers need a storage that takes parallel writers: ``postgresql://…`` or
``journal:PATH``. A SQLite file (the default when ``--storage`` is not given) locks
under parallel writers (optuna#820), and in-memory studies are not shared, so both are
refused with InputError rather than silently switched to another file: the user should
know where the study lives.

Children get ``AUTOPREC_WORKER_INDEX`` (0…N-1) and ``AUTOPREC_WORKERS`` in their
environment; the CLI (the one place that reads the environment) passes the index to
``worker_seed`` so that seeded samplers do not propose the same trials in every worker.

Ctrl-C reaches the parent only (children run in their own sessions); the parent forwards
SIGINT to every child, then SIGTERM on a second Ctrl-C, then SIGKILL on a third, and
waits for them all. The result is the worst exit code (a child killed by signal S counts
as 128+S).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from autoprec.errors import InputError
from autoprec.study.storage import describe_storage, is_parallel_safe, open_storage

WORKER_INDEX_ENV = "AUTOPREC_WORKER_INDEX"
WORKERS_ENV = "AUTOPREC_WORKERS"


def worker_seed(seed: int | None, worker_index: int | None) -> int | None:
    """Sampler seed of worker ``worker_index``: ``seed + index`` (None stays None).

    Same seed in every worker would make seeded samplers (random start-up trials of TPE,
    RandomSampler) propose the same assignments in every process.
    """
    if seed is None or not worker_index:
        return seed
    return seed + worker_index


def option_value(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
    return value


def strip_option(argv: Sequence[str], name: str) -> list[str]:
    """``argv`` without ``--name VALUE`` / ``--name=VALUE``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def check_parallel_storage(url: str | None) -> None:
    """InputError unless ``url`` can be shared by parallel workers; then open it once.

    Opening here initialises an empty PostgreSQL database before the workers race to,
    and turns a wrong URL into one error line instead of N.
    """
    if not is_parallel_safe(url):
        what = (
            "no --storage (a SQLite file)"
            if url is None
            else f"--storage '{describe_storage(url)}'"
        )
        raise InputError(
            f"--workers needs a storage that parallel workers can share, got {what}: use "
            "--storage postgresql://USER@HOST/DB (heartbeats, many machines) or "
            "journal:PATH (one machine); SQLite locks under parallel writers"
        )
    open_storage(url, Path("unused.db"))


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_workers(argv: Sequence[str], n: int, *, python: str | None = None) -> int:
    """Run ``n`` children ``python -m autoprec.cli.main <argv without --workers>``.

    ``argv`` is the command line after the program name (``["tune", "model.py", …]``).
    Returns the worst exit code of the children.
    """
    if n < 1:
        raise InputError(f"--workers must be >= 1, got {n}")
    argv = strip_option(argv, "--workers")
    check_parallel_storage(option_value(argv, "--storage"))
    cmd = [python or sys.executable, "-m", "autoprec.cli.main", *argv]
    print(
        f"autoprec: starting {n} workers on {describe_storage(option_value(argv, '--storage'))}",
        file=sys.stderr,
    )
    children: list[subprocess.Popen[bytes]] = []
    interrupts = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupts
        interrupts += 1 if signum == signal.SIGINT else 3
        sig = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[min(interrupts, 3) - 1]
        for child in children:
            if child.poll() is None:
                child.send_signal(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(n):
            env = {**os.environ, WORKER_INDEX_ENV: str(index), WORKERS_ENV: str(n)}
            # Own session: a terminal's Ctrl-C reaches only us, and we forward it once.
            children.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            if interrupts:
                forward(signal.SIGINT, None)
        codes = [_exit_code(child.wait()) for child in children]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children:  # only on an error of our own: never leave orphans
            if child.poll() is None:
                child.kill()
                child.wait()
    return max(codes, default=0)
