"""Faults beside the bad-input table: where a process boundary, a signal, a race, a full
disk or an edit between two runs matters. Each section says what used to go wrong."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from autoprec.errors import OutputError
from autoprec.io.paths import remove_stale_fronts
from autoprec.policy import Policy, load_policy
from autoprec.workload.loading import load_model_file
from tests.helpers import CLI, MODELS, TRAP, cli_env, run_cli

SLOW = MODELS / "slow_trap.py"
TRAP_SRC = TRAP.read_text()
ENV = cli_env()
#: An edit of the module class's forward that changes nothing numerically.
FORWARD_EDIT = ("        return self.head(h)  # (B, 16)",
                "        h = h * 1.0  # an edit\n        return self.head(h)  # (B, 16)")


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith(("autoprec: warning:", "autoprec: note:"))]
    assert len(lines) == 1 and lines[0].startswith("autoprec: error: "), err
    return lines[0]


# -- as a user would: a real process, a real exit status ---------------------------------

def _fifo(tmp: Path, name: str) -> Path:
    os.mkfifo(tmp / name)
    return tmp / name


SUBPROCESS_ROWS = {
    "sys.exit(3) at import": (lambda t: ["graph", _model(t, "import sys\nsys.exit(3)\n")],
                              "importing it called sys.exit(3)"),
    "sys.exit(3) in build_model": (
        lambda t: ["graph", _model(t, "def build_model():\n    raise SystemExit(3)\n")],
        "build_model() called sys.exit(3)"),
    "a FIFO as the policy": (lambda t: ["show", _fifo(t, "p.yaml")], "is a FIFO"),
    "a FIFO as model.py": (lambda t: ["graph", _fifo(t, "model.py")], "is a FIFO"),
    "/dev/zero as the policy": (lambda t: ["show", "/dev/zero"], "is a character device"),
    "/dev/zero as model.py via a symlink": (
        lambda t: ["graph", _link(t / "model.py", "/dev/zero")], "is a character device"),
}


def _model(tmp: Path, extra: str) -> Path:
    path = tmp / "model.py"
    path.write_text(TRAP_SRC + "\n" + extra)
    return path


def _link(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


@pytest.mark.parametrize("name", list(SUBPROCESS_ROWS))
def test_process_exits_2_with_one_line(name: str, tmp_path: Path) -> None:
    """A real process exits 2 (not 3, not a hang) with one line naming the file (a
    ``sys.exit(3)`` in model.py used to exit 3 silently; a FIFO hung)."""
    build, phrase = SUBPROCESS_ROWS[name]
    proc = subprocess.run([*CLI, *map(str, build(tmp_path))], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert phrase in one_error_line(proc.stderr)


def test_no_arguments_print_usage_and_exit_2(tmp_path: Path) -> None:
    """``autoprec`` alone prints the usage, not an empty 'autoprec: error: '."""
    proc = subprocess.run(CLI, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "Usage" in proc.stdout and "tune" in proc.stdout
    assert "missing command" in one_error_line(proc.stderr)


# -- SIGTERM is Ctrl-C (it exited 143 silently, leaving a RUNNING trial) -------------------

def _trials(url: str, name: str = "s") -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    except Exception:  # not created yet
        return []


@pytest.mark.slow
def test_sigterm_finishes_the_running_trial(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    proc = subprocess.Popen(
        [*CLI, "tune", str(SLOW), "--storage", url, "--study-name", "s", "--no-track",
         "--quiet", "--batch-size", "65536", "--precisions", "bf16,fp16", "--trials",
         "100000", "--pareto", "--out", str(tmp_path / "p.yaml")],
        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and \
            sum(t.state == TrialState.COMPLETE for t in _trials(url)) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what kill, systemd and Kubernetes send
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    states = [t.state for t in _trials(url)]
    assert TrialState.RUNNING not in states and states.count(TrialState.COMPLETE) >= 2


def test_sigterm_before_the_search_is_not_silent(tmp_path: Path) -> None:
    started = tmp_path / "started"
    model = _model(tmp_path, f"""
def calibration_data():
    import pathlib, time
    pathlib.Path({str(started)!r}).write_text("x")
    time.sleep(120)
    return _batches(1, 4)
""")
    proc = subprocess.Popen([*CLI, "tune", str(model), "--no-track", "--quiet", "--out",
                             str(tmp_path / "p.yaml")], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "autoprec: interrupted" in err, err[-2000:]


# -- two tunes creating one fresh SQLite study (one exited 2: table already exists) -------

def _open_and_join(url: str, barrier: mp.Barrier, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from autoprec.study.storage import join_study, open_storage

    barrier.wait()
    try:
        store = open_storage(url, Path("unused.db"))
        join_study(store, "s", fingerprint="sha256:" + "0" * 64, directions=["minimize"])
        out.put("ok")
    except Exception as err:  # reported to the parent
        out.put(f"{type(err).__name__}: {err}")


def test_racing_workers_on_a_fresh_sqlite_study(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    results = []
    for rep in range(3):
        url = f"sqlite:///{tmp_path / f'race{rep}.db'}"
        barrier, queue = ctx.Barrier(5), ctx.Queue()
        procs = [ctx.Process(target=_open_and_join, args=(url, barrier, queue))
                 for _ in range(5)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        results += [queue.get(timeout=10) for _ in procs]
    assert results == ["ok"] * len(results), results


# -- a full disk keeps the old policy, and says so in one line (was a traceback) ----------

def test_enospc_keeps_the_old_policy(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"a": "bf16"}).save(path)
    old = path.read_text()

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OutputError, match="no space left on the device; the previous file "
                                          "is unchanged"):
        Policy(default="fp16").save(path)
    assert path.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]  # no temp file left


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "256k"):
    """A tmpfs of ``size`` mounted at ``path`` (skips without root or mount)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(folder: Path) -> None:
    """Write zeros until the file system is full (ENOSPC)."""
    with contextlib.suppress(OSError), (folder / "filler").open("wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)


def test_a_really_full_disk(tmp_path: Path, capsys, monkeypatch) -> None:
    """On a real full file system: tune's policy write fails as one line, exit 2,
    and the old policy is intact; the probe cache on that disk is a warning, not a crash."""
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "p.yaml"
        Policy(default="fp32").save(out)
        old = out.read_text()
        _fill(disk)
        monkeypatch.chdir(tmp_path)
        code, _, err = run_cli(["tune", TRAP, "--no-track", "--quiet", "--trials", "2",
                                "--storage", "memory", "--precisions", "bf16,fp16",
                                "--out", out], capsys)
        assert code == 2, err
        line = one_error_line(err)
        assert f"{out}: cannot write: no space left on the device; the previous file is " \
               "unchanged" in line
        assert "probe cache not written" in err  # the warning, one line
        assert out.read_text() == old
        assert not [p for p in disk.iterdir() if p.name.endswith(".tmp")]


def test_an_unusable_default_cache_is_a_warning(tmp_path: Path, capsys, monkeypatch) -> None:
    """`.autoprec` being a file costs the cache, not the run (it was a traceback)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".autoprec").write_text("a file where the cache folder goes")
    code, _, err = run_cli(["tune", TRAP, "--no-track", "--quiet", "--trials", "2",
                            "--precisions", "bf16,fp16", "--out", tmp_path / "p.yaml"], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "autoprec: warning: probe cache not written" in err
    assert (tmp_path / ".autoprec").read_text() == "a file where the cache folder goes"
    assert load_policy(tmp_path / "p.yaml").model["name"] == "trap"  # the run wrote its policy


# -- one atomic write everywhere (probe --out, the cost profile and the probe cache were not)

def _failing_replace(monkeypatch) -> None:
    def boom(src: object, dst: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", boom)


def test_probe_csv_is_written_atomically(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "t.csv"
    out.write_text("the old table\n")
    _failing_replace(monkeypatch)
    code, _, err = run_cli(["probe", TRAP, "--quiet", "--e2e", "none", "--precisions", "bf16",
                            "--out", out], capsys)
    assert code == 2 and f"{out}: cannot write: I/O error; the previous file is unchanged" \
        in one_error_line(err)
    assert out.read_text() == "the old table\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]


def test_calibration_save_is_atomic(tmp_path: Path, monkeypatch) -> None:
    from autoprec.cost.profiles import Calibration

    path = tmp_path / "h100.yaml"
    Calibration(device="h100", efficiency={"bf16": 0.7}, n_samples=3).save(path)
    old = path.read_text()
    fsynced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(fd), real_fsync(fd))[1])
    Calibration(device="h100", efficiency={"bf16": 0.8}, n_samples=4).save(path)
    assert fsynced and yaml.safe_load(path.read_text())["efficiency"]["bf16"] == 0.8
    old = path.read_text()
    _failing_replace(monkeypatch)
    with pytest.raises(OutputError, match="previous file is unchanged"):
        Calibration(device="h100", efficiency={"bf16": 0.9}).save(path)
    assert path.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h100.yaml"]  # no fixed .tmp


def test_probe_cache_is_fsynced(tmp_path: Path, monkeypatch) -> None:
    from autoprec.probe import cache
    from autoprec.probe.table import SensitivityTable

    fsynced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(fd), real_fsync(fd))[1])
    path = cache.store(tmp_path / "c", "k" * 64, SensitivityTable([], {"cache_key": "k" * 64}))
    assert path is not None and path.exists() and fsynced


# -- edited code is not served old numbers (a study and the probe cache ignored code edits)

def _probe_cached(path: Path, cache_dir: Path) -> bool:
    from autoprec.probe import probe

    spec = load_model_file(path)
    net = spec.model()
    table = probe(net, spec.calibration_batches(), ["bf16"], forward=spec.forward,
                  e2e="none", cache_dir=cache_dir, progress=False)
    return bool(table.meta["cached"])


def test_probe_cache_sees_a_module_forward_edit(tmp_path: Path) -> None:
    """The probe cache key covers the module classes' source (a ``Module.forward`` edit
    used to be served the old numbers, ``cached: true``)."""
    model = tmp_path / "model.py"
    model.write_text(TRAP_SRC)
    cache_dir = tmp_path / "cache"
    assert _probe_cached(model, cache_dir) is False
    assert _probe_cached(model, cache_dir) is True  # same code: a hit
    model.write_text(TRAP_SRC.replace(*FORWARD_EDIT))
    assert _probe_cached(model, cache_dir) is False  # Trap.forward changed: a miss


def test_code_hash_covers_file_functions_and_classes(tmp_path: Path) -> None:
    from autoprec.workload.hashing import code_hash, module_code_hash

    model = tmp_path / "model.py"
    model.write_text(TRAP_SRC)
    spec = load_model_file(model)
    net = spec.model()
    first, classes = code_hash(spec, net), module_code_hash(net)
    assert code_hash(spec, net) == first  # stable
    model.write_text(TRAP_SRC.replace(*FORWARD_EDIT))
    spec2 = load_model_file(model)
    net2 = spec2.model()
    assert module_code_hash(net2) != classes and code_hash(spec2, net2) != first
    model.write_text(TRAP_SRC + "\ndef forward(model, batch):\n    return model(batch)\n")
    spec3 = load_model_file(model)
    assert code_hash(spec3, spec3.model()) not in (first, code_hash(spec2, net2))


def test_code_hash_is_the_same_in_every_process(tmp_path: Path) -> None:
    """Workers and later runs must agree (str hash() is salted per process)."""
    script = ("from autoprec.workload.loading import load_model_file\n"
              "from autoprec.workload.hashing import code_hash\n"
              f"s = load_model_file({str(TRAP)!r})\n"
              "print(code_hash(s, s.model()))\n")
    got = {subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True,
                          text=True, timeout=120, check=True).stdout for _ in range(2)}
    assert len(got) == 1


def test_a_study_is_tied_to_the_code(tmp_path: Path, capsys, monkeypatch) -> None:
    """After an edit of the module's forward, joining the old study by name is
    refused with the difference named; the default study name is a new study."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.py"
    model.write_text(TRAP_SRC)
    db = f"sqlite:///{tmp_path / 's.db'}"
    common = ["--no-track", "--quiet", "--trials", "2", "--precisions", "bf16,fp16",
              "--json", "--out", tmp_path / "p.yaml"]
    code, out, err = run_cli(["tune", model, *common, "--storage", db], capsys)
    assert code == 0, err
    first = yaml.safe_load(out)["study"]
    code, out, err = run_cli(["tune", model, *common, "--storage", db, "--study-name",
                              "named"], capsys)
    assert code == 0, err
    model.write_text(TRAP_SRC.replace(*FORWARD_EDIT))
    code, _, err = run_cli(["tune", model, *common, "--storage", db, "--study-name", "named"],
                           capsys)
    assert code == 2 and "was tuned with other settings (code: " in one_error_line(err)
    code, out, err = run_cli(["tune", model, *common, "--storage", db], capsys)
    assert code == 0, err
    assert yaml.safe_load(out)["study"] != first


# -- stale Pareto fronts; a missed speed target (check used to pass feasible: false) -------

def test_remove_stale_fronts_only_removes_front_files(tmp_path: Path) -> None:
    out = tmp_path / "trap.yaml"
    names = ["trap.front0.yaml", "trap.front12.yaml", "trap.frontier.yaml",
             "other.front0.yaml", "trap.front0.yml", "trap.yaml"]
    for n in names:
        (tmp_path / n).write_text("x")
    removed = remove_stale_fronts(out)
    assert sorted(p.name for p in removed) == ["trap.front0.yaml", "trap.front12.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["trap.frontier.yaml", "other.front0.yaml", "trap.front0.yml", "trap.yaml"])


def test_a_new_tune_leaves_no_stale_front(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / "p.front7.yaml"
    Policy(default="fp16").save(stale)
    code, _, err = run_cli(["tune", TRAP, "--no-track", "--quiet", "--trials", "2",
                            "--precisions", "bf16,fp16", "--out", tmp_path / "p.yaml"],
                           capsys)
    assert code == 0, err  # trap within the default budget, as in the cache test above
    assert not stale.exists() and (tmp_path / "p.yaml").exists()


def test_a_missed_speed_target_is_named_and_check_fails_it(tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    """Tune says the speed target was missed (not the budget); check fails the
    file it wrote (feasible: false)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "p.yaml"
    code, _, err = run_cli(["tune", TRAP, "--no-track", "--quiet", "--trials", "3",
                            "--min-speedup", "100", "--out", out], capsys)
    assert code == 1
    assert "no policy reaches the speed target --min-speedup 100 within budget" in \
        one_error_line(err)
    assert load_policy(out).metrics["feasible"] is False
    code, report, err = run_cli(["check", TRAP, "--policy", out], capsys)
    assert code == 1 and "tune missed its speed target" in report and not err.strip()


# -- one SQLite rule: MLflow created the folders of a URL that --storage refused ----------

def test_one_sqlite_rule_for_mlflow_and_storage(tmp_path: Path) -> None:
    from autoprec.errors import InputError, TrackingError
    from autoprec.study.storage import open_storage
    from autoprec.track import make_tracker

    missing = tmp_path / "no" / "such"
    with pytest.raises(TrackingError, match=f"directory '{missing}' does not exist"):
        make_tracker(f"sqlite:///{missing}/mlflow.db", "e")
    with pytest.raises(InputError, match=f"directory '{missing}' does not exist"):
        open_storage(f"sqlite:///{missing}/s.db", tmp_path / "d.db")
    assert not (tmp_path / "no").exists()  # neither created the folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert make_tracker(f"sqlite:///{tmp_path}/mlflow.db", "e").enabled  # it exists
