"""One root exception; subclasses carry the CLI exit code.

Exit codes (docs/overview.md): 0 done/passed, 1 check failed or nothing feasible, 2 bad input.
User-facing messages name the file, the layer or the value and the rule broken.
"""

from __future__ import annotations

import warnings


class AutoprecError(Exception):
    """Root of every error autoprec raises on purpose."""

    exit_code: int = 1


class InputError(AutoprecError):
    """Bad input from the user: usage, model.py, a policy file, a value. Exit code 2."""

    exit_code = 2


class ModelFileError(InputError):
    """model.py is missing, not Python, lacks a required function, or its data is unusable."""


class PolicyError(InputError):
    """A policy file does not validate (schema, precision, path, fingerprint, YAML)."""


class FingerprintMismatch(PolicyError):
    """The policy was written for a model of another structure (refused unless forced)."""


class PolicyWarning(UserWarning):
    """Something a reviewer should know that does not stop the policy from applying."""


def warn(message: str) -> None:
    """Emit a PolicyWarning (the CLI prints these as one line each)."""
    warnings.warn(message, PolicyWarning, stacklevel=3)


class CapabilityError(AutoprecError):
    """A precision or backend cannot run on this device; the message carries the reason."""


class CheckFailed(AutoprecError):
    """A gate did not pass: over budget, changed model, or an unrunnable precision. Exit 1."""


class OutputError(InputError):
    """A file autoprec must write cannot be written where it was asked to: the path is not
    a regular file (a FIFO, a device), its folder cannot be created or written, or the disk
    is full. Exit code 2; an atomic write leaves the previous file intact."""


class TrackingError(InputError):
    """The MLflow tracking server cannot be reached or used (found before expensive work)."""


class GuardError(AutoprecError):
    """A guarded deployment's output was not finite (``guard: raise``), or a fallback could
    not recover it; the message names the layer, its precision and the value. Exit 1."""

    def __init__(self, message: str, layer: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer


class GuardWarning(PolicyWarning):
    """A guarded layer overflowed (``guard: detect`` / ``fallback``); warned once per layer."""


class TuneInterrupted(KeyboardInterrupt):
    """A tune stopped by Ctrl-C (or SIGTERM) after its running trial: the finished trials
    are kept in the study, and the message says how to go on from them (``resume=True``).
    A KeyboardInterrupt, so that code catching Ctrl-C still catches it; ``autoprec tune``
    prints its ``cli_hint`` (the command again, with ``--resume``)."""

    def __init__(self, study: str, storage: str, finished: int) -> None:
        self.study, self.storage, self.finished = study, storage, finished
        super().__init__(f"tune interrupted: {finished} finished trial(s) kept in study "
                         f"{study!r} ({storage}); the same tune(...) call with resume=True "
                         "goes on from them")

    def cli_hint(self, argv: list[str]) -> str:
        """What ``autoprec tune`` prints: the interrupted command (``argv``, the arguments
        after ``autoprec``) again, with ``--resume``."""
        import shlex

        again = [a for a in argv if a != "--resume"]
        return (f"{self.finished} finished trial(s) kept in study {self.study!r} "
                f"({self.storage}); to go on from them: autoprec "
                f"{shlex.join([*again, '--resume'])}")
