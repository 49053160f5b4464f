"""Storage URLs, joining studies and counting trials — against a real PostgreSQL server."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import RDBStorage
from optuna.storages.journal import JournalStorage
from optuna.trial import TrialState

from autoprec.errors import InputError
from autoprec.study import storage as storage_mod
from autoprec.study.storage import (
    CONNECT_TIMEOUT,
    FINGERPRINT_ATTR,
    count_finished,
    describe_storage,
    join_study,
    open_storage,
    reap_stale_trials,
)
from tests.pg import PostgresServer

FP_A = "sha256:" + "ab" * 32
FP_B = "sha256:" + "cd" * 32

optuna.logging.set_verbosity(optuna.logging.WARNING)


# --- URLs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("mysql://user:hunter2@db/x", "unsupported scheme 'mysql'"),
        ("postgresql+asyncpg://u@h/x", "unsupported scheme"),
        ("studies.db", "not a storage URL"),
        ("sqlite://studies.db", "three slashes"),
        ("sqlite:////no/such/dir/s.db", "directory '/no/such/dir' does not exist"),
        ("journal:", "journal needs a file"),
        ("journal:/no/such/dir/j.log", "does not exist"),
        ("postgresql://nobody@127.0.0.1:1/x", "cannot open the database"),
        ("postgresql://u:hunter2@127.0.0.1:1/x", "Connection refused"),
    ],
)
def test_bad_storage_is_one_line_input_error(url: str, rule: str, monkeypatch) -> None:
    # An unreachable server fails fast: one connection attempt (a refused connection is not
    # retried like a race to create the tables), bounded by CONNECT_TIMEOUT for a host that
    # never answers.
    attempts: list[dict] = []
    real = storage_mod.RDBStorage

    def spy(url: str, engine_kwargs: dict | None = None, **kwargs):  # type: ignore[no-untyped-def]
        attempts.append(dict(engine_kwargs or {}))
        return real(url, engine_kwargs=engine_kwargs, **kwargs)

    monkeypatch.setattr(storage_mod, "RDBStorage", spy)
    with pytest.raises(InputError) as info:
        open_storage(url, Path("unused.db"))
    message = str(info.value)
    assert rule in message
    assert "\n" not in message
    assert "hunter2" not in message  # the password never reaches a log
    assert message.startswith("--storage '")
    assert info.value.exit_code == 2
    assert len(attempts) <= 1, attempts
    if url.startswith("postgresql") and attempts:
        assert attempts[0]["connect_args"]["connect_timeout"] == CONNECT_TIMEOUT


def test_sqlite_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a directory"):
        open_storage(f"sqlite:///{tmp_path}", Path("unused.db"))


def test_journal_file_that_is_not_a_journal(tmp_path: Path) -> None:
    bogus = tmp_path / "j.log"
    bogus.write_text("this is not json\n")
    with pytest.raises(InputError, match="is not an Optuna journal"):
        open_storage(f"journal:{bogus}", Path("unused.db"))


def test_describe_storage_hides_password() -> None:
    url = "postgresql+psycopg2://alice:s3cret@db.example:5432/studies"
    assert describe_storage(url) == "postgresql+psycopg2://alice:***@db.example:5432/studies"
    assert describe_storage("journal:/tmp/j.log") == "journal:/tmp/j.log"
    assert describe_storage(None, Path("out/studies.db")) == "sqlite:///out/studies.db"


def test_default_is_sqlite_beside_output_with_parents_created(tmp_path: Path) -> None:
    path = tmp_path / "policies" / "studies" / "x.db"
    storage = open_storage(None, path)
    assert isinstance(storage, RDBStorage)
    assert storage.url == f"sqlite:///{path}"
    assert path.exists()
    assert storage.get_heartbeat_interval() == 10


@pytest.mark.parametrize("url", ["memory", ":memory:"])
def test_memory_is_none(url: str) -> None:
    assert open_storage(url, Path("unused.db")) is None


def test_journal_storage_keeps_the_study_in_its_file(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'j.log'}"
    storage = open_storage(url, Path("x"))
    assert isinstance(storage, JournalStorage)
    study = join_study(storage, "S", fingerprint=FP_A, directions=["minimize"])
    study.add_trial(optuna.trial.create_trial(value=1.5))
    # a second opening of the file (another worker's) finds the study and its trial
    again = optuna.load_study(study_name="S", storage=open_storage(url, Path("x")))
    assert again.user_attrs[FINGERPRINT_ATTR] == FP_A
    assert [(t.state, t.value) for t in again.trials] == [(TrialState.COMPLETE, 1.5)]


def test_postgres_storage_has_heartbeats_and_retry(pg_url: str) -> None:
    storage = open_storage(pg_url, Path("unused.db"), heartbeat_interval=2, grace_period=5)
    assert isinstance(storage, RDBStorage)
    assert storage.url.startswith("postgresql+psycopg2://")  # our extra's driver
    assert storage.get_heartbeat_interval() == 2
    assert storage.grace_period == 5
    assert storage.get_heartbeat_stale_trial_callback() is not None
    assert storage.engine.pool._pre_ping


def test_postgres_unknown_database_is_input_error(pg_server: PostgresServer) -> None:
    with pytest.raises(InputError, match=r"'postgresql://postgres@127.*/nosuchdb'.*nosuchdb"):
        open_storage(pg_server.url("nosuchdb"), Path("unused.db"))


# --- joining studies --------------------------------------------------------------------


@pytest.fixture(params=["postgresql", "sqlite", "journal"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 's.db'}"
    return f"journal:{tmp_path / 'j.log'}"


def test_join_creates_then_joins_same_model(storage_url: str) -> None:
    storage = open_storage(storage_url, Path("unused.db"))
    first = join_study(storage, "S", fingerprint=FP_A, directions=["minimize"])
    assert first.user_attrs[FINGERPRINT_ATTR] == FP_A
    first.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    again = join_study(
        open_storage(storage_url, Path("unused.db")), "S", fingerprint=FP_A, directions=["minimize"]
    )
    assert again._study_id == first._study_id
    assert count_finished(again) == 2


def test_join_refuses_other_model(storage_url: str) -> None:
    storage = open_storage(storage_url, Path("unused.db"))
    join_study(storage, "S", fingerprint=FP_A, directions=["minimize"])
    shown = describe_storage(storage_url)
    with pytest.raises(InputError) as info:
        join_study(storage, "S", fingerprint=FP_B, directions=["minimize"], shown=shown)
    assert str(info.value) == (
        f"study 'S' in {shown} belongs to a different model "
        "(fingerprint sha256:abababababab… != sha256:cdcdcdcdcdcd…)"
    )
    assert info.value.exit_code == 2
    with pytest.raises(InputError, match="belongs to a different model"):  # storage named
        join_study(storage, "S", fingerprint=FP_B, directions=["minimize"])


def test_join_refuses_other_directions(pg_url: str) -> None:
    storage = open_storage(pg_url, Path("unused.db"))
    join_study(storage, "S", fingerprint=FP_A, directions=["minimize", "minimize"])
    with pytest.raises(
        InputError, match=r"optimises \['minimize', 'minimize'\], not \['minimize'\]"
    ):
        join_study(storage, "S", fingerprint=FP_A, directions=["minimize"])


def test_join_without_load_if_exists_refuses_existing(pg_url: str) -> None:
    storage = open_storage(pg_url, Path("unused.db"))
    join_study(storage, "S", fingerprint=FP_A, directions=["minimize"])
    with pytest.raises(InputError, match="already exists"):
        join_study(storage, "S", fingerprint=FP_A, directions=["minimize"], load_if_exists=False)


def test_foreign_study_with_trials_is_refused_empty_one_adopted(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage_mod, "FINGERPRINT_WAIT_S", 0.3)
    storage = open_storage(pg_url, Path("unused.db"))
    used = optuna.create_study(storage=storage, study_name="used")
    used.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(InputError, match="no model fingerprint"):
        join_study(storage, "used", fingerprint=FP_A, directions=["minimize"])
    optuna.create_study(storage=storage, study_name="empty")
    study = join_study(storage, "empty", fingerprint=FP_A, directions=["minimize"])
    assert study.user_attrs[FINGERPRINT_ATTR] == FP_A


def test_join_in_memory() -> None:
    study = join_study(None, "S", fingerprint=FP_A, directions=["maximize"])
    assert study.user_attrs[FINGERPRINT_ATTR] == FP_A


def test_count_finished_counts_complete_and_pruned(pg_url: str) -> None:
    study = join_study(
        open_storage(pg_url, Path("unused.db")), "S", fingerprint=FP_A, directions=["minimize"]
    )
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for state in (TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
        study.add_trial(
            optuna.trial.create_trial(
                state=state,
                params={"x": 0.5},
                distributions=dist,
                value=1.0 if state == TrialState.COMPLETE else None,
            )
        )
    study.enqueue_trial({"x": 0.1})  # WAITING
    assert count_finished(study) == 3


@pytest.mark.slow
def test_reap_fails_and_requeues_a_stale_trial(pg_url: str) -> None:
    storage = open_storage(pg_url, Path("unused.db"), heartbeat_interval=1, grace_period=1)
    study = join_study(storage, "S", fingerprint=FP_A, directions=["minimize"])
    with pytest.warns(UserWarning, match="Heartbeat"):
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    beat = time.monotonic()
    storage.record_heartbeat(trial._trial_id)  # then its worker "dies": no more beats
    reap_stale_trials(study)
    if time.monotonic() - beat < 1:  # within the grace period: a live trial is left alone
        assert study.get_trials(deepcopy=False)[0].state == TrialState.RUNNING
    # Reap until the server's clock puts the last beat more than the grace period back.
    deadline = time.monotonic() + 60
    while study.get_trials(deepcopy=False)[0].state == TrialState.RUNNING:
        assert time.monotonic() < deadline, "the trial never went stale"
        time.sleep(0.1)
        reap_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].system_attrs["failed_trial"] == trial.number
    assert trials[1].params == trial.params
