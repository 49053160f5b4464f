"""Bad input never gives a wrong answer: a table of hostile inputs.

Each row is one input — a copy of examples/trap/model.py with one thing broken, a
crafted policy file, an odd option value — the exit code it must get, and a phrase the
*one* line on stderr must contain. No row may print a traceback, and none may write a
policy. The CLI runs in-process (``main``) so the table takes seconds; the cases where a
process boundary matters (a hang, a signal, ``sys.exit``) are in test_faults_give_no_wrong_result.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from autoprec.policy import Policy
from tests.helpers import TRAP, run_cli

TRAP_SRC = TRAP.read_text()
TUNE = ["--no-track", "--quiet", "--trials", "2"]
GOOD = "autoprec_policy: 1\ndefault: fp32\nlayers: {}\n"


def trap_with(tmp: Path, extra: str = "", replace: tuple[str, str] | None = None) -> Path:
    """A copy of the trap model with ``extra`` appended (later definitions win) and/or one
    piece of its source replaced."""
    src = TRAP_SRC
    if replace is not None:
        assert replace[0] in src, replace[0]
        src = src.replace(*replace)
    path = tmp / "model.py"
    path.write_text(src + "\n" + extra)
    return path


def policy_file(tmp: Path, text: str | bytes, name: str = "p.yaml") -> Path:
    path = tmp / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@dataclass
class Case:
    """``args(tmp)`` builds the command line (creating whatever files it needs)."""

    args: Callable[[Path], list[str]]
    code: int
    phrase: str


def tune(extra: str = "", *opts: str, replace: tuple[str, str] | None = None
         ) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        return ["tune", trap_with(tmp, extra, replace), *TUNE, "--out", tmp / "out.yaml",
                *opts]
    return build


def show(text: str | bytes) -> Callable[[Path], list[str]]:
    return lambda tmp: ["show", policy_file(tmp, text)]


def check(text: str, *opts: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["check", TRAP, "--policy", policy_file(tmp, text), *opts]


def bomb(depth: int, where: str) -> str:
    """A YAML alias bomb in ``where``: 2**depth copies of 'x' from a few hundred bytes."""
    value = "[&a0 [x, x], " + ", ".join(f"&a{i} [*a{i - 1}, *a{i - 1}]"
                                         for i in range(1, depth)) + "]"
    doc = {"autoprec_policy": "1", "default": "fp32", "layers": "{}"}
    if where == "layer":
        doc["layers"] = f"{{inp: {value}}}"
    elif where == "batch_size":
        doc["target"] = f"{{device: h100, batch_size: {value}}}"
    else:
        doc[where] = value
    return "".join(f"{k}: {v}\n" for k, v in doc.items())


NAN_WEIGHTS = """
_build = build_model
def build_model():
    m = _build()
    with torch.no_grad():
        m.mid1.weight[0, 0] = float("nan")
    return m
"""
NAN_INPUTS = """
def calibration_data():
    xs = _batches(1, 4)
    xs[2][0, 0] = float("nan")
    return xs
"""
INF_OUTPUT = """
_build = build_model
def build_model():
    m = _build()
    with torch.no_grad():
        m.head.weight.fill_(3e38)  # finite weights, an output past the fp32 max
    return m
"""
ENDLESS = """
def calibration_data():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(32, 64, generator=g)
"""
METRIC = "def metric(outputs, batch):\n    {body}\n"
LOSS = "def loss(outputs, batch):\n    return {body}\n"


CASES: dict[str, Case] = {
    # 1. no floating output: error 0 over zero tensors would pass every policy
    "forward returns None": Case(tune("def forward(model, batch):\n    model(batch)\n"),
                                 2, "forward() returned no floating-point tensor"),
    "forward returns a string": Case(tune("def forward(model, batch):\n    return 'y'\n"),
                                     2, "forward() returned no floating-point tensor"),
    "forward returns a dict of ints": Case(
        tune("def forward(model, batch):\n    return {'n': 3, 'k': 'x'}\n"),
        2, "forward() returned no floating-point tensor (batch 0 of calibration_data gave a dict"),
    "forward returns an argmax": Case(
        tune("def forward(model, batch):\n    return model(batch).argmax(-1)\n"),
        2, "gave an int64 tensor of shape (32,)"),
    "check: forward returns an argmax": Case(
        lambda tmp: ["check", trap_with(tmp, "def forward(model, batch):\n    return "
                     "model(batch).argmax(-1)\n"), "--policy", policy_file(tmp, GOOD)],
        2, "forward() returned no floating-point tensor"),
    # 2. alias bombs and unbounded values, in every place the issue found them
    **{f"alias bomb in {w}": Case(show(bomb(8, w)), 2, "alias *a0: a policy may not use "
                                                       "YAML aliases")
       for w in ("autoprec_policy", "default", "layer", "batch_size")},
    "anchors alone are not aliases": Case(show("autoprec_policy: 1\ndefault: &d [x, x]\n"
                                               "layers: {}\n"), 2,
                                          "default: must be a precision name"),
    "a huge value is quoted briefly": Case(
        show(f"autoprec_policy: 1\ndefault: {'x' * 300_000}\nlayers: {{}}\n"),
        2, "default: unknown precision 'xxxxxxx"),
    # 3. --out that is not a regular file
    "--out /dev/null": Case(tune("", "--out", "/dev/null"), 2, "is a character device"),
    "--out a FIFO": Case(lambda tmp: [*tune()(tmp), "--out", _fifo(tmp / "pipe.yaml")],
                         2, "is a FIFO (named pipe), not a regular file"),
    "--out a directory": Case(lambda tmp: [*tune()(tmp), "--out", tmp], 2, "is a directory"),
    # 7. a speed target tune could not reach is named as such, and check fails the file
    "check: policy marked feasible: false (speed)": Case(
        check(GOOD + "metrics: {error: 0.002, budget: 0.01, est_speedup: 1.3, "
                     "feasible: false}\n"), 1, "tune missed its speed target"),
    "check: policy marked feasible: false (budget)": Case(
        check(GOOD + "metrics: {error: 0.2, budget: 0.01, feasible: false}\n"), 1,
        "over its budget (error 0.2 > budget 0.01)"),
    # 8. malformed YAML: keys, nesting, huge integers
    "a list as a key": Case(show("autoprec_policy: 1\ndefault: fp32\nlayers:\n  [a, b]: fp16\n"),
                            2, "p.yaml:4:3: not valid YAML: a key is a list"),
    "a mapping as a key": Case(show("autoprec_policy: 1\ndefault: fp32\nlayers:\n  ? {a: 1}\n"
                                    "  : fp16\n"), 2, "a key is a mapping"),
    "5000-deep nesting": Case(show(f"autoprec_policy: 1\ndefault: fp32\nlayers: "
                                   f"{'[' * 5000}{']' * 5000}\n"), 2, "nested deeper than"),
    "5000-digit integer": Case(show(f"autoprec_policy: {'9' * 5000}\ndefault: fp32\nlayers: {{}}\n"),
                               2, "an integer of 5000 digits"),
    "batch_size 10**400 in a policy": Case(
        show(f"autoprec_policy: 1\ntarget: {{device: h100, batch_size: 1{'0' * 400}}}\n"
             "default: fp32\nlayers: {}\n"), 2, "an integer of 401 digits"),
    "batch_size 2**40 in a policy": Case(
        show(f"autoprec_policy: 1\ntarget: {{device: h100, batch_size: {2**40}}}\n"
             "default: fp32\nlayers: {}\n"), 2, "target.batch_size: must be at most"),
    "--batch-size 10**400 (tune)": Case(tune("", "--batch-size", "1" + "0" * 400), 2,
                                        "--batch-size: must be an integer in [1,"),
    "--batch-size 10**400 (check)": Case(check(GOOD, "--batch-size", "1" + "0" * 400), 2,
                                         "--batch-size: must be an integer in [1,"),
    "--batch-size 10**400 (eval)": Case(
        lambda tmp: ["eval", TRAP, "--policy", policy_file(tmp, GOOD), "--batch-size",
                     "1" + "0" * 400], 2, "--batch-size: must be an integer in [1,"),
    # 9. metric() junk, NaN or raising — with either budget
    **{f"metric {name} ({flag})": Case(
        tune(METRIC.format(body=body), flag, "0.01"), 2, phrase)
       for name, body, phrase in (
           ("a string", "return 'high'", "metric() must return one number, got str 'high'"),
           ("a vector", "return (outputs.argmax(-1) == 0).float()",
            "metric() must return one number, got a Tensor of shape (32,)"),
           ("NaN", "return float('nan')", "metric() returned nan for the fp32 model on batch 0"),
           ("raising", "raise KeyError('label')", "metric() raised KeyError: 'label'"),
       ) for flag in ("--max-drop", "--max-error")},
    # 10. the fp32 reference itself is non-finite: say so, and where
    "NaN weights": Case(tune(NAN_WEIGHTS), 2,
                        "the fp32 reference itself is non-finite: output tensor 0 of batch 0"),
    "NaN inputs": Case(tune(NAN_INPUTS), 2, "batch 2 of calibration_data holds nan"),
    "inf output": Case(tune(INF_OUTPUT), 2, "the fp32 model overflows first in the output of "
                                            "module 'head'"),
    "check: NaN weights": Case(
        lambda tmp: ["check", trap_with(tmp, NAN_WEIGHTS), "--policy", policy_file(tmp, GOOD)],
        2, "parameter 'mid1.weight' of build_model()'s model holds non-finite values"),
    # 11. loss, empty and bare-tensor data
    "non-scalar loss --train-aware": Case(
        tune(LOSS.format(body="outputs.pow(2)"), "--train-aware"), 2,
        "loss() must return a scalar tensor, got shape (32, 16)"),
    "loss returns a float --train-aware": Case(
        tune(LOSS.format(body="1.0"), "--train-aware"), 2,
        "loss() must return a floating scalar tensor"),
    "a batch with 0 rows": Case(
        tune("def calibration_data():\n    return [torch.randn(32, 64), torch.randn(0, 64)]\n"),
        2, "batch 1 of calibration_data() has 0 rows (shape (0, 64))"),
    "a bare tensor as calibration data": Case(
        tune("def calibration_data():\n    return torch.randn(128, 64)\n"), 2,
        "calibration_data() returned one tensor of shape (128, 64); return a list of batches"),
    "a dict as eval data": Case(
        tune("def eval_data():\n    return {'x': torch.randn(32, 64)}\n"), 2,
        "eval_data() returned a dict"),
    # 12. options checked before any work
    "--seed -5": Case(tune("", "--seed", "-5"), 2, "--seed: must be an integer in [0, 4294967295]"),
    "--seed 99999999999": Case(tune("", "--seed", "99999999999"), 2, "--seed: must be"),
    "--timeout nan": Case(tune("", "--timeout", "nan"), 2, "--timeout: must be a finite number"),
    "--timeout inf": Case(tune("", "--timeout", "inf"), 2, "--timeout: must be a finite number"),
    "--min-speedup nan": Case(tune("", "--min-speedup", "nan"), 2, "--min-speedup: must be"),
    "--export-timeout -1": Case(lambda tmp: ["graph", TRAP, "--export-timeout", "-1"], 2,
                                "--export-timeout: must be a finite number of seconds >= 0"),
    "--export-timeout nan": Case(lambda tmp: ["graph", TRAP, "--export-timeout", "nan"], 2,
                                 "--export-timeout: must be"),
    "fingerprint sha256:zzzz": Case(
        show("autoprec_policy: 1\nmodel: {fingerprint: 'sha256:zzzz'}\ndefault: fp32\n"
             "layers: {}\n"), 2, "model.fingerprint: must look like 'sha256:<hex>' (64"),
    # 13. a file that is not a database
    "--storage: a text file": Case(
        lambda tmp: [*tune()(tmp), "--storage", f"sqlite:///{_text(tmp / 's.db')}"], 2,
        "is not a SQLite database"),
    "export: a text file": Case(
        lambda tmp: ["export", "--storage", f"sqlite:///{_text(tmp / 's.db')}",
                     "--study-name", "s", "--out", tmp / "e.yaml"], 2,
        "is not a SQLite database"),
    "--storage: a journal that is a database": Case(
        lambda tmp: [*tune()(tmp), "--storage", f"journal:{_sqlite(tmp / 's.db')}"], 2,
        "is not an Optuna journal"),
    # 14. where outputs cannot go
    "--out under /proc": Case(tune("", "--out", "/proc/autoprec-p.yaml"), 2, "cannot write in /proc"),
    "--out below a file": Case(lambda tmp: [*tune()(tmp), "--out", _text(tmp / "f") / "p.yaml"],
                               2, "is not a directory"),
    "probe --cache-dir a file": Case(
        lambda tmp: ["probe", TRAP, "--quiet", "--cache-dir", _text(tmp / "cache")], 2,
        "exists and is not a directory"),
    # 15. sys.exit, NUL bytes, FIFOs, endless data
    "sys.exit(3) at import": Case(tune("import sys\nsys.exit(3)\n"), 2,
                                  "importing it called sys.exit(3)"),
    "sys.exit(3) in build_model": Case(
        tune("def build_model():\n    import sys\n    sys.exit(3)\n"), 2,
        "build_model() called sys.exit(3)"),
    "sys.exit in calibration_data": Case(
        tune("def calibration_data():\n    raise SystemExit('no data')\n"), 2,
        "calibration_data() called sys.exit('no data')"),
    "NUL byte in model.py": Case(tune("x = 1\0\n"), 2,
                                 f"model.py:{TRAP_SRC.count(chr(10)) + 2}: not valid Python"),
    "NUL byte in a policy": Case(show(b"autoprec_policy: 1\ndefault: fp32\0\nlayers: {}\n"), 2,
                                 "p.yaml:2:14: not valid YAML: character #x0000"),
    "not UTF-8 policy": Case(show(b"autoprec_policy: 1\ndefault: fp32\nlayers: {\xff: a}\n"), 2,
                             "p.yaml:3: not UTF-8 text"),
    "a FIFO as the policy": Case(lambda tmp: ["show", _fifo(tmp / "p.yaml")], 2,
                                 "is a FIFO (named pipe), not a regular file"),
    "/dev/zero as the policy": Case(lambda tmp: ["show", "/dev/zero"], 2,
                                    "/dev/zero: is a character device"),
    "a FIFO as model.py": Case(lambda tmp: ["graph", _fifo(tmp / "model.py")], 2,
                               "is a FIFO (named pipe), not a regular file"),
    "an endless calibration generator": Case(tune(ENDLESS), 2,
                                             "calibration_data() yields more than 1000 batches"),
    # 18. one rule for SQLite URLs
    "--mlflow-uri in a missing folder": Case(
        lambda tmp: ["tune", TRAP, "--quiet", "--out", tmp / "p.yaml", "--mlflow-uri",
                     "sqlite:////nonexistent/dir/mlflow.db"], 2,
        "--mlflow-uri 'sqlite:////nonexistent/dir/mlflow.db': directory '/nonexistent/dir' "
        "does not exist"),
    "--storage in a missing folder": Case(
        tune("", "--storage", "sqlite:////nonexistent/dir/s.db"), 2,
        "--storage 'sqlite:////nonexistent/dir/s.db': directory '/nonexistent/dir' does not"),
}


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _text(path: Path) -> Path:
    path.write_text("not what you think\n")
    return path


def _sqlite(path: Path) -> Path:
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("create table t (x)")
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line(name: str, tmp_path: Path, capsys, monkeypatch) -> None:
    """A row that hangs (a FIFO read, an endless generator followed) is failed by pytest's
    --timeout; the row itself asserts the outcome, not how long it took."""
    case = CASES[name]
    monkeypatch.chdir(tmp_path)
    args = case.args(tmp_path)
    code, out, err = run_cli(args, capsys)
    assert "Traceback" not in err and "Traceback" not in out, err
    if code == 1 and args[0] == "check" and case.code == 1:
        # a gate that failed (not bad input): the report says why, once, on stdout
        assert not err.strip(), err
        assert "FAILED" in out and case.phrase in out, out
        return
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith(("autoprec: warning:", "autoprec: note:"))]
    assert len(lines) == 1, err
    assert len(lines[0]) < 600, lines[0][:1000]  # never an unbounded value
    assert code == case.code, err
    assert lines[0].startswith("autoprec: error: ") and case.phrase in lines[0], lines[0]
    # nothing was written in the place of a policy
    assert not (tmp_path / "out.yaml").exists()
    assert not list(tmp_path.glob("policies/*.yaml"))


def test_dev_null_stays_a_device(tmp_path: Path, capsys) -> None:
    before = os.stat("/dev/null")
    code, _, _ = run_cli(tune("", "--out", "/dev/null")(tmp_path), capsys)
    after = os.stat("/dev/null")
    assert code == 2 and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino


def test_the_alias_bomb_is_refused_before_anything_is_built(tmp_path: Path,
                                                             monkeypatch) -> None:
    """A bomb costs nothing until something walks it (its repr in an error message took
    gigabytes): the loader refuses the first alias while composing, so no value is ever
    constructed, validated or printed."""
    from autoprec.errors import PolicyError
    from autoprec.policy import load_policy
    from autoprec.policy.yaml_loader import PolicyLoader

    built: list[object] = []
    construct = PolicyLoader.construct_document

    def spy(self, node):  # type: ignore[no-untyped-def]
        built.append(node)
        return construct(self, node)

    monkeypatch.setattr(PolicyLoader, "construct_document", spy)
    for where in ("autoprec_policy", "default", "layer", "batch_size"):
        path = policy_file(tmp_path, bomb(12, where), f"{where}.yaml")
        with pytest.raises(PolicyError, match=r"alias \*a0: a policy may not use YAML "
                                              r"aliases") as info:
            load_policy(path)
        assert not built, where  # refused at the first alias, before construction
        assert len(str(info.value)) < 300
    load_policy(policy_file(tmp_path, GOOD, "good.yaml"))
    assert len(built) == 1  # the spy sees a document that is built


def test_a_policy_built_in_code_quotes_values_briefly() -> None:
    from autoprec.errors import PolicyError

    with pytest.raises(PolicyError) as info:
        Policy(target={"device": "h100", "batch_size": 10**5000})
    assert "an integer of about" in str(info.value) and len(str(info.value)) < 300
    with pytest.raises(PolicyError) as info:
        Policy(layers={"a": "x" * 10**6})
    assert len(str(info.value)) < 400


def test_an_oversized_policy_is_refused_unread(tmp_path: Path) -> None:
    from autoprec.errors import PolicyError
    from autoprec.policy import load_policy
    from autoprec.policy.schema import MAX_POLICY_BYTES

    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.truncate(MAX_POLICY_BYTES + 1)  # sparse: no disk used
    with pytest.raises(PolicyError, match="larger than a policy file may be"):
        load_policy(path)


def test_no_arguments_print_the_usage(capsys) -> None:
    code, out, err = run_cli([], capsys)
    assert code == 2 and "Usage" in out and "tune" in out
    assert err.strip() == ("autoprec: error: missing command (one of those above, e.g. "
                           "autoprec tune model.py)")


def test_out_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    """Decision (README): a symlinked --out is followed — the file it points to is
    replaced atomically, the link stays a link."""
    real = tmp_path / "v1.yaml"
    Policy(default="fp32").save(real)
    link = tmp_path / "current.yaml"
    link.symlink_to(real.name)
    Policy(default="bf16").save(link)
    assert link.is_symlink() and "default: bf16" in real.read_text()
    dangerous = tmp_path / "null.yaml"
    dangerous.symlink_to("/dev/null")
    from autoprec.errors import OutputError

    with pytest.raises(OutputError, match=r"is a character device \(the symlink points to /dev/null\)"):
        Policy(default="bf16").save(dangerous)
