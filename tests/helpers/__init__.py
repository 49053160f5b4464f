"""What many test files share: the repository's paths and one way to run the CLI.

``run_cli`` runs ``autoprec ARGS`` in this process (``main``, as the console script does)
and returns its exit code and what it printed; a test that needs a process boundary (a
signal, a hang, ``sys.exit`` inside model.py) runs ``CLI`` with ``cli_env()`` instead.

Import as ``from tests.helpers import ROOT, run_cli`` (tests/conftest.py puts the
repository root on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root
TRAP = ROOT / "examples" / "trap" / "model.py"  # the example every CLI test tunes
MODELS = ROOT / "tests" / "fixtures" / "models"  # small model.py files, good and broken

#: ``autoprec`` as a separate process (with ``env=cli_env()``).
CLI = [sys.executable, "-m", "autoprec.cli.main"]


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment with the worktree's ``autoprec`` importable."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def terminal_signals() -> None:
    """``preexec_fn`` of a child a test sends Ctrl-C to: SIGINT as in a terminal. A child
    inherits an ignored SIGINT (a suite started as a background job, ``cmd &``), and Python
    then leaves it ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(args: list[object], capsys: pytest.CaptureFixture[str], *,
            quiet_warnings: bool = False) -> tuple[int, str, str]:
    """``autoprec ARGS`` in-process (each arg as ``str``): (exit code, stdout, stderr).

    ``quiet_warnings``: Python warnings are ignored while it runs (the check/eval tests
    read ``--json`` and do not care about a hand-written policy's fingerprint warning).
    """
    from autoprec.cli.main import main

    with pytest.raises(SystemExit) as info, \
            warnings.catch_warnings() if quiet_warnings else contextlib.nullcontext():
        if quiet_warnings:
            warnings.simplefilter("ignore")
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread (the op timings' thread clock needs it), restored after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def check_speed(rows: list, timer: object, **timing: object) -> object:
    """The rows timed by ``timer`` (``evaluation.timing.time_plans``, with ``timing``'s
    device, batch size, cold timer) and decided as a tune decides them (a ``SpeedCheck``);
    with no timer, not timed (a remote target)."""
    from autoprec.evaluation.decision import Timing, decide
    from autoprec.evaluation.speed_check import SpeedCheck
    from autoprec.evaluation.timing import time_plans

    done = (Timing(note="estimated only (the target is not this machine)") if timer is None
            else time_plans(rows, timer, **timing))  # type: ignore[arg-type]
    return SpeedCheck(rows, decide(rows, done), done)


def lm_examples(n: int = 16) -> list[dict[str, Any]]:
    """``n`` causal-LM examples of 8 token ids below 100 (labels = inputs), seed 0: the
    dataset the HF Trainer and accelerate tests train on."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 100, (8,), generator=g)  # (T,)
        out.append({"input_ids": ids, "labels": ids})
    return out
