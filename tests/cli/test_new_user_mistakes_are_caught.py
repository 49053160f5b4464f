"""Hostile inputs a new user (or a script) still got through the bad-input table.

Each row: the input, the exit code, the phrase of the one line (stderr for an error,
stdout for a run that works) and the files that must be left intact byte for byte. The
CLI runs in-process; no row sleeps or depends on wall-clock limits. What needs a mount
(a read-only study, a full disk) is in the tests after the table, skipped without root.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
from torch import nn

from autoprec.apply.apply import ApplyOptions
from autoprec.policy import Policy, load_policy
from tests.cli.test_faults_give_no_wrong_result import tmpfs
from tests.helpers import TRAP, run_cli

TRAP_SRC = TRAP.read_text()
TUNE = ["--no-track", "--quiet", "--trials", "3"]
#: model.py's build_model raising: a row that must be refused before any work shows it.
NOT_BUILT = "\ndef build_model():\n    raise RuntimeError('build_model ran')\n"

ALIAS = '''
import torch
from torch import nn

MODEL_NAME = "alias"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.mid = nn.Linear(256, 256)
        self.mid2 = self.mid  # one module under two names (a real pattern)
        self.head = nn.Linear(256, 16)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid(h))
        return self.head(torch.relu(self.mid2(h)))


def build_model():
    torch.manual_seed(0)
    return Net()


def calibration_data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 64, generator=g) for _ in range(2)]
'''
TINY = '''
import torch
from torch import nn

MODEL_NAME = "{name}"


def build_model():
    torch.manual_seed(0)
    return {build}


def calibration_data():
    return [torch.randn(8, 64, generator=torch.Generator().manual_seed(1))]
'''
NO_GRAD_LOSS = ("def loss(outputs, batch):\n    with torch.no_grad():\n"
                "        return outputs.pow(2).mean()\n")
IN_PLACE = "def forward(model, batch):\n    batch.mul_(1.5)\n    return model(batch)\n"


def model_file(tmp: Path, extra: str = "", name: str = "model.py", src: str = TRAP_SRC) -> Path:
    path = tmp / name
    path.write_text(src + "\n" + extra)
    return path


def tiny(tmp: Path, build: str, name: str) -> Path:
    return model_file(tmp, src=TINY.format(name=name, build=build), name=f"{name}.py")


def sqlite_db(path: Path) -> Path:
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("create table t (x)")
    return path


def journal(path: Path) -> Path:
    path.write_bytes(b"")  # a new journal: empty
    return path


@dataclass
class Row:
    args: Callable[[Path], list[object]]
    code: int
    phrase: str
    intact: Callable[[Path], list[Path]] = field(default=lambda tmp: [])


def _tune(*opts: object, extra: str = "") -> Callable[[Path], list[object]]:
    return lambda tmp: ["tune", model_file(tmp, extra), *TUNE, "--out", tmp / "out.yaml", *opts]


ROWS: dict[str, Row] = {
    # 12. no trial completes: exit 2 naming the cause, or a policy
    "loss() under no_grad, --train-aware": Row(
        _tune("--train-aware", extra=NO_GRAD_LOSS), 2,
        "loss() returned a tensor with no gradient although the outputs have one"),
    "--timeout 0.001 still measures one plan": Row(
        _tune("--timeout", "0.001", "--batch-size", "65536"), 0, "policy: "),
    # 13. --out naming one of the run's own inputs
    "--out model.py": Row(lambda tmp: ["tune", model_file(tmp), *TUNE, "--out",
                                       tmp / "model.py"],
                          2, "is the model file this run reads",
                          lambda tmp: [tmp / "model.py"]),
    "--out the --storage SQLite file": Row(
        lambda tmp: [*_tune()(tmp), "--storage", f"sqlite:///{sqlite_db(tmp / 's.db')}",
                     "--out", tmp / "s.db"],
        2, "--out " + "{tmp}/s.db: is the --storage study file this run reads",
        lambda tmp: [tmp / "s.db"]),
    "--out the journal: file": Row(
        lambda tmp: [*_tune()(tmp), "--storage", f"journal:{journal(tmp / 'j.log')}",
                     "--out", tmp / "j.log"],
        2, "is the --storage study file this run reads", lambda tmp: [tmp / "j.log"]),
    "--out the --mlflow-uri database": Row(
        lambda tmp: ["tune", model_file(tmp), "--quiet", "--mlflow-uri",
                     f"sqlite:///{sqlite_db(tmp / 'm.db')}", "--out", tmp / "m.db"],
        2, "is the --mlflow-uri database this run reads", lambda tmp: [tmp / "m.db"]),
    "export --out its own study file": Row(
        lambda tmp: ["export", "--storage", f"sqlite:///{sqlite_db(tmp / 's.db')}",
                     "--study-name", "s", "--out", tmp / "s.db"],
        2, "is the --storage study file this run reads", lambda tmp: [tmp / "s.db"]),
    "probe --out model.py": Row(
        lambda tmp: ["probe", model_file(tmp), "--quiet", "--out", tmp / "model.py"],
        2, "is the model file this run reads", lambda tmp: [tmp / "model.py"]),
    # 14. TorchScript
    "a TorchScript model": Row(
        lambda tmp: ["tune", tiny(tmp, "torch.jit.script(nn.Linear(64, 64))", "ts"), *TUNE],
        2, "build_model() returned a TorchScript module (RecursiveScriptModule)"),
    "graph of a TorchScript model": Row(
        lambda tmp: ["graph", tiny(tmp, "torch.jit.script(nn.Linear(64, 64))", "ts")],
        2, "returned a TorchScript module"),
    # 15. no GEMM
    "tune nn.Identity": Row(lambda tmp: ["tune", tiny(tmp, "nn.Identity()", "ident"), *TUNE],
                            2, "ident.py has no GEMM layer (Linear, Conv, matmul, attention)"),
    "eval nn.Identity": Row(
        lambda tmp: ["eval", tiny(tmp, "nn.Identity()", "ident"), "--policy",
                     model_file(tmp, src="autoprec_policy: 1\ndefault: bf16\n", name="p.yaml")],
        0, "est. speed-up 1.00x"),
    "check nn.Identity": Row(
        lambda tmp: ["check", tiny(tmp, "nn.Identity()", "ident"), "--policy",
                     model_file(tmp, src="autoprec_policy: 1\ndefault: bf16\n", name="p.yaml")],
        0, "PASSED"),
    # 16. malformed PostgreSQL URLs: before any work (build_model would raise)
    "--storage postgresql bad port": Row(
        _tune("--storage", "postgresql://u@localhost:notaport/db", extra=NOT_BUILT), 2,
        "not a valid PostgreSQL URL: the port is not a number"),
    "--storage postgresql port 99999": Row(
        _tune("--storage", "postgresql://u@localhost:99999/db", extra=NOT_BUILT), 2,
        "port 99999 is not in [1, 65535]"),
    # 22. an input changed in place
    "forward() changes its input in place": Row(
        _tune(extra=IN_PLACE), 2, "forward() changes its input in place"),
    # 23. MODEL_NAME escaping policies/; a precision list the target cannot run
    "MODEL_NAME ../../escaped": Row(
        lambda tmp: ["tune", model_file(tmp, 'MODEL_NAME = "../../escaped"\n'), *TUNE], 2,
        "MODEL_NAME must be a plain name"),
    "--precisions mxfp8 --target h100": Row(
        _tune("--precisions", "mxfp8", "--target", "h100", extra=NOT_BUILT), 2,
        "--precisions mxfp8: the target h100 runs none of them (mxfp8: Hopper"),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_new_user_row(name: str, tmp_path: Path, capsys, monkeypatch) -> None:
    row = ROWS[name]
    work = tmp_path / "a" / "b"  # MODEL_NAME ../../x would land in tmp_path
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    args = row.args(work)
    before = {p: p.read_bytes() for p in row.intact(work)}
    code, out, err = run_cli(args, capsys)
    assert "Traceback" not in err and "Traceback" not in out, err
    assert "RuntimeWarning" not in err, err
    assert code == row.code, err or out
    if row.code == 0:
        assert row.phrase in out, out
    else:
        lines = [ln for ln in err.strip().splitlines()
                 if not ln.startswith(("autoprec: warning:", "autoprec: note:"))]
        assert len(lines) == 1, err
        assert row.phrase.format(tmp=work) in lines[0], lines[0]
        assert not (work / "out.yaml").exists()
    for p, blob in before.items():
        assert p.read_bytes() == blob, f"{p} was changed"
    assert not list(tmp_path.glob("*escaped*")) and not list(work.parent.glob("*escaped*"))


def test_an_aliased_module_tunes_to_one_precision(tmp_path: Path, capsys, monkeypatch) -> None:
    """`self.mid2 = self.mid` — every trial used to fail on a rule for `mid` that `mid2`
    did not share. The module takes one precision; the written policy checks, and a root
    rule is folded into the default (a root rule `'': fp16` under `default: bf16` left the
    default unused)."""
    monkeypatch.chdir(tmp_path)
    path = model_file(tmp_path, src=ALIAS, name="alias.py")
    code, out, err = run_cli(["tune", path, *TUNE, "--batch-size", "65536", "--out",
                              tmp_path / "p.yaml"], capsys)
    assert code == 0, err
    # an early end says so, with counts (the bar stopped at "1/40 [2%]", like an abort);
    # the next steps are printed
    assert "search complete (" in out and "plans priced, 1 measured)" in out, out
    from autoprec.cli.runnable import autoprec_command

    assert f"next: {autoprec_command()} check {path} --policy {tmp_path / 'p.yaml'}" in out, out
    assert 'autoprec.apply_policy(model, "' in out
    from autoprec.workload.loading import load_model_file

    net = load_model_file(path).model()
    policy = load_policy(tmp_path / "p.yaml", model=net)
    assert "" not in policy.layers  # compact: `'': X` under another default is the default
    assert policy.metrics["feasible"] is True and policy.metrics["est_speedup"] > 1.5
    code, out, err = run_cli(["check", path, "--policy", tmp_path / "p.yaml"], capsys)
    assert code == 0 and "PASSED" in out, out + err


def test_optuna_failure_tracebacks_stay_off_the_console(capsys) -> None:
    """Optuna logs every failed trial with its traceback (a second Ctrl-C
    is a KeyboardInterrupt inside a trial); the reason is on the trial, the console keeps
    one line."""
    from autoprec.study.driver import _quiet_failed_trials

    def boom(trial: optuna.Trial) -> float:
        raise ValueError("a trial failed")

    optuna.logging.set_verbosity(logging.WARNING)
    study = optuna.create_study()
    with _quiet_failed_trials():
        study.optimize(boom, n_trials=2, catch=(ValueError,))
    _, err = capsys.readouterr()
    assert "Traceback" not in err and "failed" not in err, err
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]


def test_no_completed_trial_is_one_line_not_a_value_error() -> None:
    """A study where every trial failed names the first reason (exit 2), not
    ``ValueError: no completed trials to choose from``."""
    from autoprec.errors import InputError
    from autoprec.study.driver import Driver

    study = optuna.create_study()
    trial = study.ask()
    trial.set_user_attr("fail_reason", "PolicyError: something about 'mid'")
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    driver = Driver.__new__(Driver)  # only the study and the trial count are read
    driver.study, driver.sampler = study, SimpleNamespace(ran=1)  # ran: the sampler's count
    err = driver.nothing_measured("s")
    assert isinstance(err, InputError) and err.exit_code == 2
    assert "all 1 trials failed, the first with PolicyError: something about 'mid'" in str(err)


# -- a read-only mount, a full disk (need root to mount a tmpfs) ----------------------------

def _tmpfs(path: Path, size: str = "4m"):
    return tmpfs(path, size)


def _remount_ro(path: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith(("autoprec: warning:", "autoprec: note:"))]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_a_study_on_a_read_only_mount(tmp_path: Path, capsys, monkeypatch) -> None:
    """`--resume` on a study whose file system is read-only: one line naming the
    storage, exit 2 (was a StorageInternalError traceback); the study is intact."""
    monkeypatch.chdir(tmp_path)
    path = model_file(tmp_path, src=ALIAS, name="alias.py")
    with _tmpfs(tmp_path / "ro") as ro:
        url = f"sqlite:///{ro / 's.db'}"
        args = ["tune", path, *TUNE, "--batch-size", "65536", "--storage", url,
                "--study-name", "s", "--out", tmp_path / "p.yaml"]
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        blob = (ro / "s.db").read_bytes()
        _remount_ro(ro)
        code, _, err = run_cli([*args, "--resume", "--trials", "5"], capsys)
        assert code == 2, err
        line = _one_line(err)
        assert f"--storage '{url}': cannot write the study: the database is read-only" in line
        assert (ro / "s.db").read_bytes() == blob


def test_a_disk_that_fills_up_under_the_study(tmp_path: Path, capsys, monkeypatch) -> None:
    """The study's disk is full: one line saying "no space left", exit 2 (was
    `AssertionError: Should not reach.`); the old policy survives."""
    monkeypatch.chdir(tmp_path)
    path = model_file(tmp_path, src=ALIAS, name="alias.py")
    out = tmp_path / "p.yaml"
    Policy(default="fp32").save(out)
    old = out.read_text()
    with _tmpfs(tmp_path / "disk", size="256k") as disk:
        with contextlib.suppress(OSError), (disk / "filler").open("wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        code, _, err = run_cli(["tune", path, *TUNE, "--batch-size", "65536", "--storage",
                                f"sqlite:///{disk / 's.db'}", "--out", out], capsys)
    assert code == 2, err
    assert "cannot write the study: no space left on the device" in _one_line(err)
    assert out.read_text() == old


def test_storage_failure_reads_optunas_wrapped_causes() -> None:
    """A full disk without a mount: a trial write that failed on a full disk surfaces as
    Optuna's `AssertionError: Should not reach.` with the cause in its context."""
    import sqlite3

    import sqlalchemy.exc

    from autoprec.study.storage import storage_failure

    cause = sqlalchemy.exc.OperationalError("UPDATE trials", {},
                                            sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise optuna.exceptions.StorageInternalError("commit failed") from cause
        except optuna.exceptions.StorageInternalError:
            raise AssertionError("Should not reach.") from None
    except AssertionError as err:
        wrapped = err
    wrapped.__context__ = cause
    found = storage_failure(wrapped, "sqlite:///s.db")
    assert found is not None and found.exit_code == 2
    assert "no space left on the device" in str(found)
    ro = sqlalchemy.exc.OperationalError(
        "INSERT", {}, sqlite3.OperationalError("attempt to write a readonly database"))
    assert "read-only" in str(storage_failure(ro, "sqlite:///s.db"))
    assert storage_failure(ValueError("unrelated"), "x") is None


def test_a_read_only_mlflow_store_is_refused_up_front(tmp_path: Path, capsys,
                                                       monkeypatch) -> None:
    """A read-only MLflow store: one line before any work (was ~110 s of MLflow retries,
    36 warnings)."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    with _tmpfs(tmp_path / "ro") as ro:
        _remount_ro(ro)
        code, _, err = run_cli(["tune", model_file(tmp_path, NOT_BUILT), "--quiet",
                                "--mlflow-uri", f"sqlite:///{ro / 'mlflow.db'}", "--out",
                                tmp_path / "p.yaml"], capsys)
    assert code == 2, err
    assert "cannot write the MLflow store" in _one_line(err)


# -- copy.deepcopy of a model under a policy (the copy ran the original's modules); --------
# -- apply_policy's arguments (an AttributeError from inside autoprec) ----------------------

def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_deepcopy_under_a_policy_is_an_independent_model() -> None:
    """The copy must never call the original's modules: with its weights zeroed it outputs
    zeros, before and after the original's handle is removed, and takes its own policy."""
    import autoprec

    model, x = _net(), torch.randn(8, 16)
    handle = autoprec.apply_policy(model, Policy(default="bf16", layers={"2": "fp32"}),
                                   options=ApplyOptions(device="cpu"))
    y = model(x)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.count_nonzero(twin(x)) == 0  # its own (zero) weights
    assert torch.equal(model(x), y)  # the original still runs its policy, unchanged
    handle.remove()
    assert torch.count_nonzero(twin(x)) == 0
    with autoprec.apply_policy(twin, Policy(default="bf16"), options=ApplyOptions(device="cpu")):
        assert torch.count_nonzero(twin(x)) == 0
    # the copy is a plain model: fp32 outputs, the same numbers as the unwrapped original
    fresh = copy.deepcopy(_net())
    with autoprec.apply_policy(fresh, Policy(default="bf16"), options=ApplyOptions(device="cpu")):
        plain = copy.deepcopy(fresh)
    assert torch.equal(plain(x), _net()(x))


@pytest.mark.parametrize("model, policy, phrase", [
    ("net", None, "policy must be a Policy or the path of a policy file, got NoneType"),
    ("net", {"default": "bf16"}, "got dict (Policy.from_dict(d) builds one"),
    (None, "policy", "model must be a torch.nn.Module, got NoneType"),
    ("script", "policy", "model is a TorchScript module"),
])
def test_apply_policy_argument_errors(model, policy, phrase) -> None:
    import autoprec
    from autoprec.errors import InputError

    net = {"net": _net(), None: None, "script": torch.jit.script(_net())}[model]
    pol = Policy(default="bf16") if policy == "policy" else policy
    with pytest.raises(InputError) as info:
        autoprec.apply_policy(net, pol)
    assert phrase in str(info.value)


def test_apply_policy_takes_a_path(tmp_path: Path) -> None:
    import autoprec

    path = tmp_path / "p.yaml"
    path.write_text("autoprec_policy: 1\ndefault: bf16\n")  # no `layers`: no rules
    model = _net()
    with autoprec.apply_policy(model, str(path), options=ApplyOptions(device="cpu")) as handle:
        assert handle.policy.default == "bf16" and handle.policy.layers == {}
