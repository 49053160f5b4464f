"""The tracker interface ``tune`` talks to, and the tracker that does nothing (``--no-track``).

Call order (one tuning run)::

    tracker = make_tracker(uri, experiment)      # checks the store; TrackingError if unusable
    run_id = tracker.start(name, params, tags)   # the parent run; TrackingError if it fails
    tracker.log_trial(number, params, metrics)   # one child run per trial; any thread/process
    tracker.log_metrics({...}); tracker.set_tags({...}); tracker.log_artifact(path)
    tracker.finish("FINISHED")                   # or "FAILED" / "KILLED"

Contract for implementations:

- ``start`` is the last call allowed to raise (:class:`~autoprec.errors.TrackingError`):
  it runs before the expensive work. After it succeeds, no method raises because of the
  tracking backend: a failure is reported once as a :class:`TrackingWarning` and the
  tracker disables itself (``enabled`` becomes False), so a dead server never costs the
  tuning result. Programming errors (an unknown ``finish`` status) still raise.
- No global state: no "active run"; every call names its run explicitly, so trials that
  finish concurrently (Optuna ``n_jobs``, several worker processes) cannot cross-log.
- Arguments are not mutated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Any

#: Run statuses ``finish`` accepts (MLflow's terminal states).
FINISH_STATUSES: tuple[str, ...] = ("FINISHED", "FAILED", "KILLED")


class TrackingWarning(UserWarning):
    """Tracking stopped (or one artifact was skipped); the tuning itself goes on."""


class Tracker(ABC):
    """Records one tuning run: a parent run, one child run per trial, metrics, artifacts."""

    #: The parent run's id once ``start`` succeeded; None before, and always for NullTracker.
    run_id: str | None = None

    @property
    def enabled(self) -> bool:
        """False for NullTracker and for a tracker that disabled itself after a failure."""
        return True

    @abstractmethod
    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> str | None:
        """Create the parent run (explicitly, never as a global active run); return its id.

        ``params`` are logged once (e.g. budget, target, seed, model name, fingerprint,
        n_layers); ``tags`` link the Optuna study (``autoprec.study``, ``autoprec.storage``).
        Raises TrackingError when the run cannot be created.
        """

    @abstractmethod
    def log_trial(
        self,
        number: int,
        params: dict[str, Any],
        metrics: dict[str, float],
        tags: dict[str, str] | None = None,
    ) -> None:
        """Log one trial as a child run of the parent (safe from several threads/processes).

        ``params`` is the trial's assignment (layer path -> precision), ``metrics`` its
        scores (error, est_speedup, ...). A tag ``autoprec.state`` holding an Optuna state
        (``COMPLETE``, ``PRUNED``, ``FAIL``) sets the child's status (FINISHED, KILLED,
        FAILED).
        """

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Log metrics on the parent run."""

    @abstractmethod
    def set_tags(self, tags: dict[str, str]) -> None:
        """Set tags on the parent run."""

    @abstractmethod
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload one file to the parent run, under ``artifact_path`` (a folder) if given."""

    @abstractmethod
    def finish(self, status: str = "FINISHED") -> None:
        """End the parent run with ``status`` (one of FINISH_STATUSES); idempotent."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # An interrupted run is KILLED, a crashed one FAILED; a clean exit FINISHED.
        if exc_type is None:
            self.finish("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("KILLED")
        else:
            self.finish("FAILED")


class NullTracker(Tracker):
    """Tracks nothing (``--no-track``): every method is a no-op and ``start`` returns None."""

    run_id: str | None = None

    @property
    def enabled(self) -> bool:
        return False

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> str | None:
        return None

    def log_trial(
        self,
        number: int,
        params: dict[str, Any],
        metrics: dict[str, float],
        tags: dict[str, str] | None = None,
    ) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float]) -> None:
        return None

    def set_tags(self, tags: dict[str, str]) -> None:
        return None

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        return None

    def finish(self, status: str = "FINISHED") -> None:
        check_status(status)

    def __repr__(self) -> str:
        return "NullTracker()"


def check_status(status: str) -> None:
    """Raise ValueError for a status ``finish`` does not know (a programming error)."""
    if status not in FINISH_STATUSES:
        raise ValueError(f"finish status must be one of {FINISH_STATUSES}, but got {status!r}")
