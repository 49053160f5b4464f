"""Ctrl-C on a running ``autoprec tune``: finished trials are kept, ``--resume`` goes on
without running any of them again."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.helpers import CLI, MODELS, cli_env, terminal_signals

SLOW = MODELS / "slow_trap.py"  # trap, 0.2 s a batch


def _complete(url: str) -> list[optuna.trial.FrozenTrial]:
    try:
        study = optuna.load_study(study_name="s", storage=url)
    except Exception:  # not created yet
        return []
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


@pytest.mark.slow
def test_ctrl_c_then_resume_reruns_no_finished_trial(tmp_path: Path) -> None:
    """A Pareto tune (several front points to measure) of a slow model, interrupted after
    two measured trials, then resumed: the stored trials stay as they are and no plan is
    measured twice."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    cmd = [*CLI, "tune", str(SLOW), "--storage", url, "--study-name", "s", "--no-track",
           "--quiet", "--batch-size", "65536", "--pareto", "--precisions", "bf16,fp16",
           "--out", str(tmp_path / "p.yaml")]
    env = cli_env()
    proc = subprocess.Popen([*cmd, "--trials", "100000"], cwd=tmp_path, env=env,
                            preexec_fn=terminal_signals,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_complete(url)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    before = {t.number: t.params for t in _complete(url)}
    assert len(before) >= 2
    done = subprocess.run([*cmd, "--trials", "100", "--resume", "--json"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    after = {t.number: t.params for t in _complete(url)}
    assert len(after) > len(before)
    assert all(after[k] == v for k, v in before.items())  # the finished ones are kept as is
    plans = [tuple(sorted(p.items())) for p in after.values()]
    assert len(plans) == len(set(plans))  # and none was measured again


@pytest.mark.slow
def test_ctrl_c_of_a_calibrating_tune_then_the_hinted_resume_joins_its_study(
        tmp_path: Path) -> None:
    """``--target cpu`` in a fresh folder: the first run calibrates this machine (and caches
    the calibration, rounded), the second reads the cache. Both must name the study alike:
    Ctrl-C the first once it has a finished trial, run the command its interrupt message
    prints, and that run joins the first one's study (its trials kept, no second study)."""
    import json
    import shlex

    from tests.helpers import TRAP

    cmd = [*CLI, "tune", str(TRAP), "--target", "cpu", "--no-track", "--quiet",
           "--trials", "2", "--out", str(tmp_path / "p.yaml")]
    url = f"sqlite:///{tmp_path / 'studies' / 'trap.db'}"
    env = cli_env()
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                preexec_fn=terminal_signals,
                                stderr=stderr, text=True)

    def finished() -> int:
        try:
            (name,) = optuna.get_all_study_names(url)
            study = optuna.load_study(study_name=name, storage=url)
        except Exception:  # not created yet
            return 0
        return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    deadline = time.monotonic() + 240
    while finished() < 1 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    # in the search, or in the confirmation after it; again if the first one was lost (a
    # KeyboardInterrupt raised inside a garbage-collection callback is ignored by Python)
    for _ in range(20):
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        if proc.poll() is not None or "autoprec: interrupted" in log.read_text():
            break
    proc.wait(timeout=120)
    err = log.read_text()
    assert proc.returncode == 130, err[-2000:]
    assert (tmp_path / ".autoprec" / "calibration").is_dir()  # it calibrated here
    (name,) = optuna.get_all_study_names(url)
    before = {t.number: t.params
              for t in optuna.load_study(study_name=name, storage=url).get_trials()
              if t.state == TrialState.COMPLETE}
    assert err.strip().splitlines()[-1] == "autoprec: interrupted"
    hints = [x for x in err.splitlines() if "to go on from them: autoprec " in x]
    assert len(hints) == 1, err[-3000:]
    hint = hints[0]
    assert repr(name) in hint, err[-2000:]
    again = shlex.split(hint.split("to go on from them: autoprec ", 1)[1])
    assert again[-1] == "--resume"
    done = subprocess.run([*CLI, *again, "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["study"] == name
    assert optuna.get_all_study_names(url) == [name]  # joined, not a new study
    after = optuna.load_study(study_name=name, storage=url).get_trials()
    assert all(after[k].params == v for k, v in before.items())


def test_a_ctrl_c_python_drops_in_a_gc_callback_is_raised_before_the_write() -> None:
    """Python prints and drops a KeyboardInterrupt raised inside a weakref / GC callback
    (SQLAlchemy's pool has such callbacks): the tune records every Ctrl-C and its check
    before the write raises the dropped one."""

    class Thing:
        pass

    reached = []
    # Python's own Ctrl-C handler, as in a terminal (a background job or a test worker may
    # have inherited SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _drop_one_ctrl_c(Thing, reached)
    finally:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
        signal.signal(signal.SIGINT, before)
    assert reached == [True]


def _drop_one_ctrl_c(thing_type: type, reached: list[bool]) -> None:
    import gc
    import weakref

    from autoprec.tuning.tune import _resumable

    with pytest.raises(KeyboardInterrupt), _resumable([]) as check:
        thing = thing_type()

        def on_collect(_: object) -> None:
            signal.raise_signal(signal.SIGINT)
            for _i in range(100):  # the handler runs here, inside the callback
                pass

        ref = weakref.ref(thing, on_collect)
        del thing
        gc.collect()
        reached.append(ref() is None)  # the interrupt was dropped: execution goes on
        check()
