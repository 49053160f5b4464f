"""MLflow behind the :class:`~autoprec.track.base.Tracker` interface.

MLflow is imported only inside this module's functions, so ``import autoprec`` stays
light and ``--no-track`` never loads it.

Why not ``optuna.integration.MLflowCallback``: it has no parent run and logs through
MLflow's global "active run", so parallel trials cross-log (optuna#5148). Here every call
goes through an ``MlflowClient`` with an explicit run id; a trial is a child run carrying
the tag ``mlflow.parentRunId``.

Stores (``make_tracker``):

- ``uri=None``: MLflow's embedded SQLite store in the working directory,
  ``sqlite:///WORKDIR/mlflow.db``, artifacts in ``WORKDIR/mlruns`` (MLflow's own default
  layout, so ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` run there shows it).
- ``sqlite:///PATH``: the same, artifacts in an ``mlruns`` folder beside the database.
  PATH's folder must exist (the rule ``--storage`` follows; ``paths.check_sqlite_url``).
- ``http(s)://HOST:PORT``: a tracking server; artifacts go where the server puts them.
- anything else MLflow accepts (``postgresql://``, ``databricks``...) is passed through.

Failing fast: ``make_tracker`` checks the store before any expensive work. For a server it
first opens the server's ``/health`` with a short timeout (no retries), because MLflow's
default HTTP retries (7, exponential backoff) take minutes to give up. For the rest of the
run, MLflow's HTTP retry settings are bounded (2 retries, backoff factor 1, 30 s timeout)
unless the user set them, so a server that dies mid-run costs seconds, not minutes; the
"View run at" lines MLflow prints on stdout for each terminated run are suppressed (they
would break ``--json`` output). These are MLflow's environment-variable-backed settings,
set here and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from autoprec import __version__
from autoprec.errors import TrackingError
from autoprec.io.extras import require
from autoprec.io.paths import check_sqlite_url, sqlite_file
from autoprec.track.base import NullTracker, Tracker, TrackingWarning, check_status

#: Seconds the reachability check waits for a tracking server to answer.
CHECK_TIMEOUT_S = 5.0

#: MLflow settings bounded for the run unless the user set them (see the module docstring).
_HTTP_SETTINGS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}

# MLflow's limits (mlflow/utils/validation.py): keys <= 250 chars of [/\w.\- :];
# param values <= 6000 chars, tag values <= 8000; per log_batch <= 100 params or tags,
# <= 1000 metrics.
_KEY_OK = re.compile(r"[^/\w.\- :]")
_MAX_KEY = 250
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000

#: Optuna trial state -> MLflow run status of the child run.
_TRIAL_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}

#: Database stores reached over the network (checked with one short connection attempt).
_NETWORK_DATABASES = ("postgresql", "mysql")

PARENT_TAG = "mlflow.parentRunId"  # mlflow.utils.mlflow_tags.MLFLOW_PARENT_RUN_ID


def default_tracking_uri(workdir: Path) -> str:
    """MLflow's embedded SQLite store in ``workdir``: ``sqlite:///WORKDIR/mlflow.db``."""
    return f"sqlite:///{Path(workdir).resolve()}/mlflow.db"


def _check_sqlite_writable(uri: str) -> None:
    """A SQLite store (and its mlruns/ beside it) can be written, checked in milliseconds:
    MLflow itself would retry for minutes and print dozens of warnings first."""
    from autoprec.errors import OutputError
    from autoprec.io.fileio import check_writable

    db = sqlite_file(uri)
    if db is None:
        return
    try:
        if db.is_file():
            with db.open("r+b"):  # opening for writing is enough: EROFS / EACCES show here
                pass
        check_writable(db.parent / "mlruns" / ".autoprec-write-check")
    except (OSError, OutputError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise TrackingError(f"--mlflow-uri '{_redact(uri)}': cannot write the MLflow store "
                            f"({why}); give a writable --mlflow-uri, or --no-track") from None


def _artifact_location(uri: str) -> str | None:
    """Artifacts beside a SQLite database; None lets MLflow (or the server) decide."""
    if uri.startswith("sqlite:///") and ":memory:" not in uri:
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        return (db.parent / "mlruns").as_uri()
    return None


def _short(err: BaseException) -> str:
    """One line for a warning or an error message: the first line, at most 300 chars."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."


def _redact(uri: str) -> str:
    """The URI without a password (``user:secret@`` -> ``user:***@``)."""
    return re.sub(r"(//[^:/@]+:)[^@/]*@", r"\1***@", uri)


def _key(key: Any) -> str:
    # A module path is a valid key; anything else is made one (the root module's path is "").
    text = _KEY_OK.sub("_", str(key))[:_MAX_KEY]
    return text or "_root"


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _apply_http_settings() -> None:
    import mlflow.environment_variables as env

    for name, value in _HTTP_SETTINGS.items():
        var = getattr(env, name, None)
        if var is not None and not var.is_set():
            var.set(value)


class MlflowTracker(Tracker):
    """Tracks one tuning run in MLflow through explicit run ids (no global active run).

    Picklable: a copy sent to a worker process opens its own client and logs children
    under the same parent. Thread-safe: calls are serialised by a per-process lock.
    """

    def __init__(self, uri: str, experiment: str, *, artifact_location: str | None = None):
        self.uri = uri
        self.experiment = experiment
        self.artifact_location = artifact_location
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self._client: Any = None
        self._lock = threading.Lock()
        self._disabled = False
        self._finished = False

    # -- state ------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return not self._disabled

    @property
    def shown_uri(self) -> str:
        """The URI for messages: a password in it is masked."""
        return _redact(self.uri)

    @property
    def is_http(self) -> bool:
        return urlparse(self.uri).scheme in ("http", "https")

    @property
    def run_url(self) -> str | None:
        """The parent run's page on a tracking server (None for a local store)."""
        if not (self.is_http and self.run_id and self.experiment_id):
            return None
        return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"MlflowTracker(uri={self.shown_uri!r}, experiment={self.experiment!r}, "
            f"run_id={self.run_id!r}, enabled={self.enabled})"
        )

    @property
    def client(self) -> Any:
        """This process's ``MlflowClient`` (created on first use)."""
        if self._client is None:
            from mlflow import MlflowClient

            if self.is_http:
                _apply_http_settings()
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    # -- checks and the parent run ----------------------------------------------------------

    def connect(self) -> None:
        """Check the store and get or create the experiment; TrackingError if unusable."""
        if self.is_http:
            self._probe_server()
        elif self.uri.startswith(_NETWORK_DATABASES):
            self._probe_database()
        try:
            with self._lock:
                self.experiment_id = self._get_or_create_experiment()
        except TrackingError:
            raise
        except Exception as err:
            raise TrackingError(
                f"MLflow tracking store {self.shown_uri} is not usable: {_short(err)}"
            ) from err

    def _probe_server(self) -> None:
        import requests

        url = f"{self.uri.rstrip('/')}/health"
        try:
            requests.get(url, timeout=CHECK_TIMEOUT_S)
        except requests.exceptions.SSLError:
            return  # reachable; MLflow's own TLS settings decide whether it is usable
        except requests.exceptions.RequestException as err:
            raise TrackingError(
                f"cannot reach the MLflow tracking server at {self.shown_uri} "
                f"(no answer within {CHECK_TIMEOUT_S:g} s: {_short(err)}); "
                "start it, fix --mlflow-uri, or pass --no-track"
            ) from err

    def _probe_database(self) -> None:
        # One connection attempt with a short timeout: MLflow's own engine creation retries
        # 10 times with exponential backoff (mlflow/store/db/utils.py), minutes in all.
        import sqlalchemy
        from sqlalchemy.pool import NullPool

        try:
            engine = sqlalchemy.create_engine(
                self.uri,
                poolclass=NullPool,
                connect_args={"connect_timeout": max(1, round(CHECK_TIMEOUT_S))},
            )
            try:
                with engine.connect():
                    pass
            finally:
                engine.dispose()
        except Exception as err:
            raise TrackingError(
                f"cannot connect to the MLflow tracking database {self.shown_uri} "
                f"({_short(err)}); start it, fix --mlflow-uri, or pass --no-track"
            ) from err

    def _get_or_create_experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        client = self.client
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return str(
                    client.create_experiment(
                        self.experiment, artifact_location=self.artifact_location
                    )
                )
            except MlflowException as err:
                # Another worker created it between our look-up and our create.
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {self.experiment!r} at {self.shown_uri} is deleted; "
                "restore it (mlflow experiments restore) or choose another --experiment"
            )
        return str(experiment.experiment_id)

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> str | None:
        if self.run_id is not None:
            raise RuntimeError(f"tracker already started (parent run {self.run_id})")
        if self.experiment_id is None:
            self.connect()
        try:
            with self._lock:
                from mlflow.tracking.context.registry import resolve_tags

                # MLflow's context tags (user, source, git commit), then ours.
                all_tags = resolve_tags({"autoprec.version": __version__, **tags})
                run = self.client.create_run(
                    self.experiment_id, run_name=name, tags=self._tags(all_tags)
                )
                self.run_id = str(run.info.run_id)
                self._log_batch(self.run_id, params=params)
        except Exception as err:
            run_id, self.run_id = self.run_id, None
            if run_id is not None:
                # Best effort: the error below is the one to report.
                with contextlib.suppress(Exception):
                    self.client.set_terminated(run_id, "FAILED")
            raise TrackingError(
                f"cannot create the MLflow run in experiment {self.experiment!r} at "
                f"{self.shown_uri}: {_short(err)}"
            ) from err
        return self.run_id

    # -- logging (never raises after start) ------------------------------------------------

    def log_trial(
        self,
        number: int,
        params: dict[str, Any],
        metrics: dict[str, float],
        tags: dict[str, str] | None = None,
    ) -> None:
        parent = self._parent()
        # The parent link last: a caller's tag cannot re-parent the child.
        all_tags = {"autoprec.trial": str(number), **(tags or {}), PARENT_TAG: parent}
        state = str(all_tags.get("autoprec.state", "COMPLETE")).upper().removeprefix("TRIALSTATE.")
        status = _TRIAL_STATUS.get(state, "FINISHED")

        def log() -> None:
            client = self.client
            child = client.create_run(
                self.experiment_id, run_name=f"trial-{number}", tags=self._tags(all_tags)
            )
            child_id = child.info.run_id
            self._log_batch(child_id, params=params, metrics=metrics)
            # The same scores as series on the parent (step = trial number): the UI's charts.
            self._log_batch(
                parent, metrics={f"trials/{k}": v for k, v in metrics.items()}, step=number
            )
            client.set_terminated(child_id, status)

        self._safely(f"logging trial {number}", log)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        parent = self._parent()
        self._safely("logging metrics", lambda: self._log_batch(parent, metrics=metrics))

    def set_tags(self, tags: dict[str, str]) -> None:
        parent = self._parent()
        self._safely("setting tags", lambda: self._log_batch(parent, tags=tags))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        parent = self._parent()
        path = Path(path)
        if not path.is_file():
            # A missing file is not the store's fault: skip it, keep tracking.
            warnings.warn(
                f"autoprec: artifact {path} does not exist; not logged to MLflow",
                TrackingWarning,
                stacklevel=2,
            )
            return
        self._safely(
            f"uploading {path.name}",
            lambda: self.client.log_artifact(parent, str(path), artifact_path),
        )

    def finish(self, status: str = "FINISHED") -> None:
        check_status(status)
        if self.run_id is None or self._finished:
            return
        self._finished = True
        run_id = self.run_id
        self._safely("ending the run", lambda: self.client.set_terminated(run_id, status))

    # -- helpers ----------------------------------------------------------------------------

    def _parent(self) -> str:
        if self.run_id is None:
            raise RuntimeError("call start() before logging to the tracker")
        return self.run_id

    def _safely(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action``; on any failure warn once and disable the tracker."""
        if self._disabled:
            return
        try:
            with self._lock:
                if self._disabled:  # another thread failed while we waited
                    return
                action()
        except Exception as err:
            self._disable(what, err)

    def _disable(self, what: str, err: BaseException) -> None:
        if self._disabled:
            return
        self._disabled = True
        warnings.warn(
            f"autoprec: MLflow tracking at {self.shown_uri} stopped ({what} failed: "
            f"{_short(err)}); tuning continues and its results are kept locally",
            TrackingWarning,
            stacklevel=4,
        )

    @staticmethod
    def _tags(tags: dict[str, Any]) -> dict[str, str]:
        return {_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in tags.items()}

    def _log_batch(
        self,
        run_id: str,
        *,
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, Any] | None = None,
        step: int = 0,
    ) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        param_list = [Param(_key(k), str(v)[:_MAX_PARAM_VALUE]) for k, v in (params or {}).items()]
        metric_list = [
            Metric(_key(k), float(v), now, step)
            for k, v in (metrics or {}).items()
            if v is not None
        ]
        tag_list = [RunTag(k, v) for k, v in self._tags(tags or {}).items()]
        batches: Iterable[dict[str, list[Any]]] = [
            *({"params": chunk} for chunk in _chunks(param_list, _PARAMS_PER_BATCH)),
            *({"metrics": chunk} for chunk in _chunks(metric_list, _METRICS_PER_BATCH)),
            *({"tags": chunk} for chunk in _chunks(tag_list, _PARAMS_PER_BATCH)),
        ]
        for batch in batches:
            self.client.log_batch(run_id, **batch)


def make_tracker(
    uri: str | None,
    experiment: str,
    enabled: bool = True,
    workdir: Path | None = None,
) -> Tracker:
    """The tracker for one tuning run, checked before any expensive work.

    ``enabled=False`` (``--no-track``) gives a NullTracker. ``uri=None`` uses MLflow's
    embedded SQLite store in ``workdir`` (default: the current directory at call time):
    ``WORKDIR/mlflow.db`` with artifacts in ``WORKDIR/mlruns``. Raises TrackingError (exit
    code 2), one line naming the URI, when a server does not answer or a store is unusable.
    """
    if not enabled:
        return NullTracker()
    require("mlflow", "MLflow tracking", "turn it off: --no-track")
    workdir = Path.cwd() if workdir is None else Path(workdir)
    if uri is None:
        uri = default_tracking_uri(workdir)
    # The rule --storage follows: a SQLite file's folder must exist (MLflow would create it).
    check_sqlite_url(uri, "--mlflow-uri", _redact(uri), TrackingError)
    _check_sqlite_writable(uri)
    # MLflow logs "Creating initial MLflow database tables..." at INFO on a new SQLite
    # store; the CLI's stderr is for progress and errors.
    logging.getLogger("mlflow.store").setLevel(logging.WARNING)
    tracker = MlflowTracker(uri, experiment, artifact_location=_artifact_location(uri))
    tracker.connect()
    return tracker
