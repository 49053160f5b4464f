"""Trials per minute with 1, 2 and 4 workers on one PostgreSQL study.

Starts its own throwaway PostgreSQL server (tests/pg.py), then for each worker count
runs that many processes on a fresh database for ``--seconds`` each and reports
completed trials per minute of wall time (first trial start to last trial end, read
from the study, so interpreter start-up is not counted).

The objective is synthetic (6 "layers" x 3 precisions, a fixed score) plus a fixed
amount of work per trial: ``--work cpu`` spins the CPU (a trial of a real tune on this
CPU-only machine is forward passes, i.e. CPU-bound), ``--work sleep`` waits (a trial
bound by a GPU or I/O). CPU-bound trials cannot scale past the core count; sleeping ones
show the sampler's and the storage's overhead. The sampler is TPE (``--sampler``),
seeded per worker.

    .venv/bin/python -m benchmarks.workers_scaling [--seconds 20] [--work cpu|sleep]
        [--model tests/fixtures/models/mlp.py]   # also N real `autoprec tune` processes
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from autoprec.study.storage import join_study, open_storage  # noqa: E402
from autoprec.study.workers import worker_seed  # noqa: E402

FINGERPRINT = "sha256:" + "00" * 32
SAMPLERS = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
TIME = {"fp32": 1.0, "bf16": 0.55, "fp16": 0.5}
ERROR = {"fp32": 0.0, "bf16": 0.004, "fp16": 0.002}


def objective(trial: optuna.Trial, work: str, work_s: float) -> float:
    choices = [trial.suggest_categorical(f"layer{i}", list(TIME)) for i in range(6)]
    if work == "sleep":
        time.sleep(work_s)
    else:
        end = time.process_time() + work_s  # CPU seconds, so a shared core takes longer
        x = 0.0
        while time.process_time() < end:
            x += sum(i * i for i in range(1000)) * 1e-12
    est_time = sum(TIME[c] * (1 + i % 3) for i, c in enumerate(choices))
    error = sum(ERROR[c] * (i + 1) for i, c in enumerate(choices))
    return est_time + 1000.0 * max(0.0, error - 0.02)


def worker(url: str, index: int, seconds: float, work: str, work_s: float, sampler: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = join_study(
        open_storage(url, Path("unused.db")),
        "scaling",
        fingerprint=FINGERPRINT,
        directions=["minimize"],
        sampler=SAMPLERS[sampler](seed=worker_seed(0, index)),
    )
    study.optimize(lambda t: objective(t, work, work_s), timeout=seconds)


def measure(url: str, n: int, args: argparse.Namespace) -> tuple[int, float]:
    """Run n workers on the study at ``url``; returns (completed trials, wall seconds)."""
    open_storage(url, Path("unused.db"))  # create the tables before the workers start
    cmd = [sys.executable, __file__, "--worker", url, "--seconds", str(args.seconds)]
    cmd += ["--work", args.work, "--work-s", str(args.work_s), "--sampler", args.sampler]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([*cmd, "--index", str(i)], env=env) for i in range(n)]
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"worker failed with exit code {proc.returncode}")
    study = optuna.load_study(study_name="scaling", storage=open_storage(url, Path("x")))
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    start = min(t.datetime_start for t in done if t.datetime_start)
    end = max(t.datetime_complete for t in done if t.datetime_complete)
    return len(done), (end - start).total_seconds()


def measure_tune(
    url: str, n: int, args: argparse.Namespace, workdir: Path
) -> tuple[int, float, float]:
    """Run n ``autoprec tune`` processes on one study.

    Returns (finished trials, seconds from the first trial's start to the last one's end,
    seconds of the whole run including each process's start-up: imports, trace, probes).
    """
    began = time.monotonic()
    cmd = [sys.executable, "-m", "autoprec.cli.main", "tune", str(args.model.resolve())]
    cmd += ["--storage", url]
    cmd += ["--study-name", "scaling", "--trials", str(args.tune_trials), "--no-track"]
    cmd += ["--quiet", "--json", "--target", "h100"]
    procs = [
        subprocess.Popen(
            [*cmd, "--out", str(workdir / f"w{n}-{i}.yaml"), "--seed", str(i)],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
        )
        for i in range(n)
    ]
    for proc in procs:
        if proc.wait() not in (0, 1):  # 1: no feasible policy, still a finished run
            raise SystemExit(f"autoprec tune failed with exit code {proc.returncode}")
    study = optuna.load_study(study_name="scaling", storage=open_storage(url, Path("x")))
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    start = min(t.datetime_start for t in done if t.datetime_start)
    end = max(t.datetime_complete for t in done if t.datetime_complete)
    return len(done), (end - start).total_seconds(), time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="run time per worker count")
    parser.add_argument("--work", choices=("cpu", "sleep"), default="cpu")
    parser.add_argument("--work-s", type=float, default=0.1, help="work per trial, seconds")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--sampler", choices=sorted(SAMPLERS), default="tpe")
    parser.add_argument("--model", type=Path, help="also time `autoprec tune` on this model.py")
    parser.add_argument("--tune-trials", type=int, default=8, help="--trials per tune worker")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one worker
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.index, args.seconds, args.work, args.work_s, args.sampler)
        return

    from tests.pg import postgres_server

    counts = [int(n) for n in args.workers.split(",")]
    rows, tune_rows, tune_whole = [], [], []
    with postgres_server() as pg, tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            trials, wall = measure(pg.create_database(f"scaling_{n}"), n, args)
            rows.append((n, trials, wall, 60.0 * trials / wall))
        if args.model is not None:
            for n in counts:
                url = pg.create_database(f"tune_{n}")
                trials, wall, whole = measure_tune(url, n, args, Path(tmp))
                tune_rows.append((n, trials, wall, 60.0 * trials / wall))
                tune_whole.append((n, trials, whole, 60.0 * trials / whole))
    print(
        f"\nworkers scaling: {args.work} work of {args.work_s:g} s per trial, {args.sampler}, "
        f"PostgreSQL, {args.seconds:g} s per row, {os.cpu_count()} CPU cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    table(rows)
    if tune_rows:
        print(
            f"\nautoprec tune {args.model.name}, {args.tune_trials} trials per worker; "
            "wall from the first trial's start to the last trial's end:\n"
        )
        table(tune_rows)
        print("\nthe same runs, wall of the whole run (start-up: imports, trace, probes):\n")
        table(tune_whole)


def table(rows: list[tuple[int, int, float, float]]) -> None:
    """Print workers / trials / wall / trials per minute / speed-up over the first row."""
    print(
        f"{'workers':>7}  {'trials':>6}  {'wall s':>6}  {'trials/min':>10}  {'speedup':>7}  {'per worker':>10}"
    )
    counts = [r[0] for r in rows]
    base = rows[0][3] / rows[0][0]
    for n, trials, wall, rate in rows:
        print(
            f"{n:>7}  {trials:>6}  {wall:>6.1f}  {rate:>10.1f}  {rate / (base * counts[0]):>6.2f}x  {rate / n / base:>9.0%}"
        )
    best = max(rows, key=lambda r: r[3])
    print(f"\nbest: {best[0]} workers, {best[3] / rows[0][3]:.2f}x the trials/min of {rows[0][0]}")


if __name__ == "__main__":
    main()
