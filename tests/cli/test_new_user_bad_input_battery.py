"""What a new user runs into first, from the command line: each bad input is one line on
stderr and exit 2, with no traceback, before any work, and nothing half-written — a save
to where no folder can be, a model whose weights accelerate offloaded (on ``meta``) at
every command that reads it, a model whose two reference runs differ enough to change a
decision."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from autoprec.policy import Policy
from tests.helpers import TRAP, run_cli

pytest.importorskip("accelerate")

OFFLOADED = '''
import torch, accelerate

def build_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return accelerate.disk_offload(net, {folder!r}, execution_device="cpu")

def calibration_data():
    return [torch.randn(4, 8)]
'''

RANDOM = TRAP.read_text() + '''

def forward(model, batch):  # noise of 1e-3 relative: far more than rounding
    y = model(batch)
    return y * (1 + 1e-3 * torch.randn(y.shape))
'''


def _offloaded(tmp: Path) -> Path:
    path = tmp / "offloaded.py"
    path.write_text(OFFLOADED.format(folder=str(tmp / "offload")))
    return path


def _policy(tmp: Path) -> Path:
    path = tmp / "p.yaml"
    Policy(default="bf16", form="deploy").save(path)
    return path


def _taken(tmp: Path) -> Path:
    path = tmp / "notes.txt"
    path.write_text("keep me\n")
    return path


#: name -> (the command line built in a folder, a phrase of the one line)
CASES: dict[str, tuple[Callable[[Path], list[object]], str]] = {
    "save to /proc": (lambda t: ["save", TRAP, "--policy", _policy(t), "--out", "/proc/ck"],
                      "--out /proc/ck: cannot write in /proc"),
    "save over a file": (lambda t: ["save", TRAP, "--policy", _policy(t), "--out", _taken(t)],
                         "exists and is not a folder"),
    "tune offloaded": (lambda t: ["tune", _offloaded(t), "--no-track", "--quiet", "--out",
                                  t / "out.yaml"], "parameter '0.weight' is on the meta device"),
    "eval offloaded": (lambda t: ["eval", _offloaded(t), "--policy", _policy(t)],
                       "parameter '0.weight' is on the meta device"),
    "check offloaded": (lambda t: ["check", _offloaded(t), "--policy", _policy(t)],
                        "parameter '0.weight' is on the meta device"),
    "save offloaded": (lambda t: ["save", _offloaded(t), "--policy", _policy(t), "--out",
                                  t / "ckpt"], "parameter '0.weight' is on the meta device"),
    "random model": (lambda t: ["tune", t / "model.py", "--no-track", "--quiet", "--out",
                                t / "out.yaml"], "not deterministic"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.py").write_text(RANDOM)
    build, phrase = CASES[case]
    args = build(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = run_cli(args, capsys, quiet_warnings=True)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("autoprec: error: ") and phrase in lines[0], lines[0]
    assert "Traceback" not in err + out
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
             and "offload" not in p.parts[-2]}  # accelerate's own offload files
    assert {p: b for p, b in before.items() if "offload" not in p.parts[-2]} == after
