"""Parallel workers on one study: real processes, a real PostgreSQL server, real kills.

The workers run this file as a script (``python test_workers.py worker URL STUDY …``)
with a synthetic objective: 6 "layers" x 3 precisions scored by a fixed function, plus a
short sleep so trials of different workers overlap. No torch needed. The tests wait for
events (a trial in storage, a line on a pipe), never for a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import optuna
import pytest
from optuna.trial import TrialState

from autoprec.errors import InputError
from autoprec.study.storage import join_study, open_storage
from autoprec.study.workers import (
    WORKER_INDEX_ENV,
    option_value,
    run_workers,
    strip_option,
    worker_seed,
)
from tests.helpers import CLI, MODELS, ROOT, cli_env

FINGERPRINT = "sha256:" + "5e" * 32
HEARTBEAT, GRACE = 1, 3  # seconds; short so a dead worker's trial goes stale in-test
T = TypeVar("T")

# --- the synthetic objective and the worker process ---------------------------------

LAYERS = 6
#: Relative time of a layer at each precision and the error it adds (made-up, fixed).
TIME = {"fp32": 1.0, "bf16": 0.55, "fp16": 0.5}
ERROR = {"fp32": 0.0, "bf16": 0.004, "fp16": 0.002}


def synthetic_objective(trial: optuna.Trial, worker: int, sleep_s: float) -> float:
    choices = [trial.suggest_categorical(f"layer{i}", list(TIME)) for i in range(LAYERS)]
    trial.set_user_attr("worker", worker)  # after the params: a trial seen with it is complete
    trial.set_user_attr("pid", os.getpid())
    # The workload, not a synchronisation: a trial lasts sleep_s so that trials of
    # different workers overlap and a worker can be killed while its trial is RUNNING.
    time.sleep(sleep_s)
    est_time = sum(TIME[c] * (1 + i % 3) for i, c in enumerate(choices))
    error = sum(ERROR[c] * (i + 1) for i, c in enumerate(choices))
    return est_time + 1000.0 * max(0.0, error - 0.02)  # over a 2% budget: heavily penalised


def worker_main(url: str, study_name: str, trials: int, index: int, sleep_s: float,
                stop_file: str | None = None) -> None:
    """Run up to ``trials`` trials; stop early once ``stop_file`` exists."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(url, Path("unused.db"), heartbeat_interval=HEARTBEAT, grace_period=GRACE)
    study = join_study(
        storage,
        study_name,
        fingerprint=FINGERPRINT,
        directions=["minimize"],
        sampler=optuna.samplers.RandomSampler(seed=worker_seed(0, index)),
    )
    ran: list[int] = []

    def after(s: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
        ran.append(t.number)
        if stop_file is not None and Path(stop_file).exists():
            s.stop()

    study.optimize(
        lambda t: synthetic_objective(t, index, sleep_s),
        n_trials=trials,
        callbacks=[after],
    )
    print(json.dumps({"worker": index, "trials": len(ran)}), flush=True)


def start_worker(
    url: str, study: str, trials: int, index: int, sleep_s: float, stop_file: Path | None = None
) -> subprocess.Popen[str]:
    env = cli_env()
    args = [sys.executable, __file__, "worker", url, study, str(trials), str(index), str(sleep_s)]
    if stop_file is not None:
        args.append(str(stop_file))
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, int]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def wait_for(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``condition`` until it returns a value (returned); fail saying ``what`` after
    ``timeout`` s — a bound against hanging, far above the time the event takes."""
    deadline = time.monotonic() + timeout
    while (value := condition()) is None:
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def load(url: str, name: str = "S") -> optuna.Study:
    storage = open_storage(url, Path("unused.db"), heartbeat_interval=HEARTBEAT, grace_period=GRACE)
    return optuna.load_study(study_name=name, storage=storage)


def by_state(study: optuna.Study) -> dict[TrialState, int]:
    counts: dict[TrialState, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state] = counts.get(t.state, 0) + 1
    return counts


# --- PostgreSQL --------------------------------------------------------------------------


@pytest.mark.slow
def test_three_workers_on_postgres_account_for_every_trial(pg_url: str) -> None:
    # All three start on an empty database: they race to create the tables and the study.
    procs = [start_worker(pg_url, "S", 12, i, 0.1) for i in range(3)]
    reports = [finish(p) for p in procs]
    study = load(pg_url)
    counts = by_state(study)
    assert (
        counts
        == {TrialState.COMPLETE: sum(r["trials"] for r in reports)}
        == {TrialState.COMPLETE: 36}
    )
    workers = [t.user_attrs["worker"] for t in study.trials]
    assert sorted(set(workers)) == [0, 1, 2]
    assert all(workers.count(i) == 12 for i in range(3))
    starts = sorted((t.datetime_start, t.datetime_complete) for t in study.trials)
    assert any(b[0] < a[1] for a, b in zip(starts, starts[1:]))  # trials really overlapped
    assert study.user_attrs["fingerprint"] == FINGERPRINT


def _trials_of(storage: optuna.storages.BaseStorage) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name="S", storage=storage).get_trials(deepcopy=False)
    except KeyError:  # the study is not created yet
        return []


@pytest.mark.slow
def test_killed_worker_trial_is_failed_and_requeued(pg_url: str, tmp_path: Path) -> None:
    # Once the victim's last heartbeat is GRACE s old, a survivor starting its next trial
    # fails the stale one and re-queues it; a survivor then runs the copy. The survivors go
    # on until the test has seen that, then stop (400 trials of 0.3 s bound them).
    stop = tmp_path / "stop"
    procs = [start_worker(pg_url, "S", 400, i, 0.3, stop_file=stop) for i in range(3)]
    victim, survivors = procs[0], procs[1:]
    storage = open_storage(pg_url, Path("unused.db"))  # the workers create the tables
    try:
        running = wait_for(lambda: next(
            (t for t in _trials_of(storage)
             if t.state == TrialState.RUNNING and t.user_attrs.get("worker") == 0), None),
            120, "worker 0 never started a trial")
        victim.send_signal(signal.SIGKILL)
        victim.communicate()
        wait_for(lambda: next(
            (t for t in _trials_of(storage) if t.state == TrialState.COMPLETE
             and t.system_attrs.get("failed_trial") == running.number), None),
            120, "no survivor re-ran the killed worker's trial")
        stop.touch()
        reports = [finish(p) for p in survivors]
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()

    study = load(pg_url)
    trials = study.get_trials(deepcopy=False)
    dead = trials[running.number]
    assert dead.state == TrialState.FAIL
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == running.number]
    assert len(retried) == 1
    copy = retried[0]
    assert copy.system_attrs["retry_history"] == [running.number]
    assert copy.params == dead.params and len(dead.params) == LAYERS
    assert copy.state == TrialState.COMPLETE  # a survivor picked the WAITING copy up
    assert copy.user_attrs["worker"] in (1, 2)

    counts = by_state(study)
    assert TrialState.RUNNING not in counts and TrialState.WAITING not in counts
    assert counts[TrialState.FAIL] == 1
    by_victim = sum(
        1 for t in trials if t.state == TrialState.COMPLETE and t.user_attrs["worker"] == 0
    )
    assert counts[TrialState.COMPLETE] == sum(r["trials"] for r in reports) + by_victim
    for r in reports:  # each survivor's own count agrees with the storage
        assert r["trials"] == sum(1 for t in trials if t.state == TrialState.COMPLETE
                                  and t.user_attrs["worker"] == r["worker"]), r


# --- journal file ------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_share_a_journal_file(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.log'}"
    reports = [finish(p) for p in [start_worker(url, "S", 10, i, 0.05) for i in range(2)]]
    study = load(url)
    assert [r["trials"] for r in reports] == [10, 10]
    assert by_state(study) == {TrialState.COMPLETE: 20}
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) > 10  # seeds differ


# --- run_workers -------------------------------------------------------------------------


def test_option_helpers() -> None:
    argv = ["tune", "m.py", "--workers", "3", "--storage=journal:j.log", "--trials", "5"]
    assert strip_option(argv, "--workers") == [
        "tune",
        "m.py",
        "--storage=journal:j.log",
        "--trials",
        "5",
    ]
    assert strip_option(["tune", "--workers=2"], "--workers") == ["tune"]
    assert option_value(argv, "--storage") == "journal:j.log"
    assert option_value(argv, "--trials") == "5"
    assert option_value(argv, "--out") is None
    assert worker_seed(7, 0) == 7 and worker_seed(7, 2) == 9 and worker_seed(None, 2) is None


@pytest.mark.parametrize("storage", [None, "sqlite:///studies.db", "memory", "mysql://u:pw@h/x"])
def test_run_workers_refuses_storage_workers_cannot_share(storage: str | None) -> None:
    argv = ["tune", "m.py", "--trials", "5"] + (["--storage", storage] if storage else [])
    with pytest.raises(InputError, match="--workers needs a storage that parallel workers") as info:
        run_workers(argv, 2)
    assert "pw" not in str(info.value)


def test_run_workers_refuses_unreachable_server_before_starting_any() -> None:
    with pytest.raises(InputError, match="cannot open the database"):
        run_workers(["tune", "--storage", "postgresql://nobody@127.0.0.1:1/x"], 2)


FAKE_CLI = """#!{python}
import os, signal, sys
log = {log!r}
index = os.environ["{env}"]
with open(log, "a") as fh:
    fh.write(index + " " + " ".join(sys.argv[1:]) + "\\n")
if "--sleep" in sys.argv:
    # SIGINT blocked before saying "ready": a forwarded Ctrl-C is then awaited, never lost
    # to a child that has not set up yet. 60 s bound a parent that never forwards it.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    os.write(1, (index + " ready\\n").encode())  # one write: lines of two children never mix
    if signal.sigtimedwait([signal.SIGINT], 60) is None:
        sys.exit(1)
    with open(log, "a") as fh:
        fh.write(index + " got SIGINT\\n")
    sys.exit(130)
sys.exit(int(index))
"""


def fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """An 'interpreter' that logs its arguments and exits with its worker index."""
    log = tmp_path / "calls.log"
    exe = tmp_path / "fake-python"
    exe.write_text(FAKE_CLI.format(python=sys.executable, log=str(log), env=WORKER_INDEX_ENV))
    exe.chmod(0o755)
    return exe, log


def test_run_workers_starts_n_children_and_returns_worst_code(tmp_path: Path) -> None:
    exe, log = fake_python(tmp_path)
    argv = ["tune", "m.py", "--workers", "3", "--storage", f"journal:{tmp_path / 'j.log'}"]
    assert run_workers(argv, 3, python=str(exe)) == 2  # children exit 0, 1, 2
    lines = sorted(log.read_text().splitlines())
    assert lines == [
        f"{i} -m autoprec.cli.main tune m.py --storage journal:{tmp_path / 'j.log'}"
        for i in range(3)
    ]


def test_run_workers_forwards_ctrl_c(tmp_path: Path) -> None:
    exe, log = fake_python(tmp_path)
    code = (
        "import sys; from autoprec.study.workers import run_workers; "
        f"sys.exit(run_workers(['tune', '--sleep', '--storage', 'journal:{tmp_path / 'j'}'], 2, "
        f"python={str(exe)!r}))"
    )
    # The children inherit the parent's stdout: each says "ready" there once it waits.
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    ready = sorted(parent.stdout.readline().strip() for _ in range(2))
    assert ready == ["0 ready", "1 ready"], ready
    parent.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does to the parent
    _, err = parent.communicate(timeout=30)
    assert parent.returncode == 130, err
    assert sorted(line for line in log.read_text().splitlines() if "SIGINT" in line) == [
        "0 got SIGINT",
        "1 got SIGINT",
    ]


def test_children_command_is_runnable() -> None:
    # run_workers starts `python -m autoprec.cli.main …`: the module must run as a script.
    done = subprocess.run(
        [*CLI, "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout


# --- end to end: `autoprec tune` workers on one PostgreSQL study -------------------------

MODEL = MODELS / "mlp.py"
OTHER_MODEL = ROOT / "tests" / "track" / "fixtures" / "mlp3.py"


def _tune_cmd(model: Path, url: str, out: Path, trials: int, *extra: str) -> list[str]:
    return [
        *CLI,
        "tune",
        str(model),
        "--storage",
        url,
        "--study-name",
        "S",
        "--trials",
        str(trials),
        "--target",
        "h100",
        "--no-track",
        "--json",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow
def test_three_tune_processes_share_one_postgres_study(pg_url: str, tmp_path: Path) -> None:
    env = cli_env()
    procs = [
        subprocess.Popen(
            _tune_cmd(MODEL, pg_url, tmp_path / f"p{i}.yaml", 4),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        # 0: at mlp.py's calibration batch (2) no plan beats fp32 on h100 (launch-bound), and
        # fp32's error, 0, is within the default budget: every process writes it, feasible
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out))
        assert results[-1]["feasible"] and results[-1]["error"] == 0.0, results[-1]
    study = load(pg_url)
    counts = by_state(study)
    assert TrialState.RUNNING not in counts and TrialState.WAITING not in counts, counts
    # each process runs at most --trials 4; the shared walk may complete sooner
    assert len(study.trials) == sum(r["trials"] for r in results) <= 12
    measured = [tuple(sorted(t.params.items())) for t in study.trials if "error" in t.user_attrs]
    assert measured and len(measured) == len(set(measured))  # no plan measured twice
    assert all(Path(r["policy"]).exists() for r in results)
    assert {r["study"] for r in results} == {"S"}

    # Another model may not join the study: exit 2 with one line naming the rule.
    other = subprocess.run(
        _tune_cmd(OTHER_MODEL, pg_url, tmp_path / "o.yaml", 1),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert other.returncode == 2, other.stderr[-3000:]
    assert "belongs to a different model (fingerprint sha256:" in other.stderr


@pytest.mark.slow
def test_tune_with_workers_flag(pg_url: str, tmp_path: Path) -> None:
    env = cli_env()
    cmd = _tune_cmd(MODEL, pg_url, tmp_path / "p.yaml", 3, "--workers", "2", "--quiet")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]  # the worst worker's: both feasible (above)
    assert "starting 2 workers on postgresql://postgres@127.0.0.1" in done.stderr
    study = load(pg_url)
    assert by_state(study).get(TrialState.RUNNING) is None
    assert 1 <= len(study.trials) <= 6


if __name__ == "__main__" and sys.argv[1] == "worker":
    url, study_name, trials, index, sleep_s, *stop_file = sys.argv[2:]
    worker_main(url, study_name, int(trials), int(index), float(sleep_s), *stop_file)
