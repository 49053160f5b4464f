"""Ctrl-C on a running ``autoprec tune``: finished trials are kept, ``--resume`` goes on
without running any of them again."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.helpers import CLI, MODELS, cli_env

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
