"""model.py loading and ``autoprec graph`` / ``autoprec env`` on the command line.

Bad input is exit 2 with one line on stderr that names the file and the problem.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from autoprec.errors import ModelFileError
from autoprec.workload.loading import default_forward, load_model_file
from tests.helpers import CLI, MODELS, cli_env, run_cli


def bad_graph(path: Path | str, capsys: pytest.CaptureFixture[str]) -> str:
    """`autoprec graph PATH` must exit 2 with one stderr line; return that line."""
    code, out, err = run_cli(["graph", str(path)], capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autoprec: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("no_build.py", "required function build_model() is missing"),
        ("no_calibration.py", "required function calibration_data() is missing"),
        ("build_not_callable.py", "build_model must be a function"),
        ("build_raises.py", "build_model() raised ValueError: hidden_size 30 is not divisible by 4 heads"),
        ("not_module.py", "build_model() must return a torch.nn.Module, got OrderedDict"),
        ("double_weights.py", "must return fp32, bf16 or fp16 weights; parameter 'weight' is float64"),
        ("empty_calibration.py", "calibration_data() yielded no batches"),
        ("rejects_batch.py", "the model rejected batch 0 of calibration_data(): RuntimeError: mat1 and mat2"),
        ("import_raises.py", "importing it raised ModuleNotFoundError: No module named 'autoprec_no_such_package'"),
    ],
)  # fmt: skip
def test_bad_model_files_exit_2(
    name: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = bad_graph(MODELS / name, capsys)
    assert str(MODELS / name) in line
    assert expected in line


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = bad_graph(tmp_path / "model.py", capsys)
    assert line.endswith("model.py: no such file")


def test_not_python(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "model.py"
    bad.write_text("def build_model(:\n    pass\n")
    assert "model.py:1: not valid Python" in bad_graph(bad, capsys)
    text = tmp_path / "model.txt"
    text.write_text("build_model = 1\n")
    assert "not a Python file (expected a .py file)" in bad_graph(text, capsys)
    assert "is a directory" in bad_graph(tmp_path, capsys)


def test_usage_error_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["graph"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_load_model_file_spec() -> None:
    spec = load_model_file(MODELS / "mlp.py")
    assert spec.name == "mlp" and spec.forward is default_forward and spec.metric is None
    assert len(spec.calibration_batches()) == 2
    assert spec.eval_batches()[0].shape == (2, 100)  # eval_data defaults to calibration
    with pytest.raises(ModelFileError, match="rejected batch 3 of eval"):
        spec.run(spec.model(), "not a tensor", 3, "of eval")


def test_graph_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["graph", str(MODELS / "mlp.py")], capsys)
    assert code == 0
    assert "in_features 100 not a multiple of 16" in out
    assert "tracer: fx" in out and "FLOPs/pass: 33,792" in out  # 2*2*(100*64 + 64*32)
    code, out, _ = run_cli(["graph", str(MODELS / "mlp.py"), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["model"] == "mlp" and data["tracer"] == "fx"
    assert data["edges"] == [["0", "3"]] and data["batch_size"] == 2
    assert {row["path"] for row in data["layers"]} == {"", "0", "1", "2", "3"}
    code, out, _ = run_cli(["graph", str(MODELS / "mlp.py"), "--hooks-only"], capsys)
    assert code == 0 and "tracer: hooks" in out


def test_env(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["env", "--json"], capsys)
    data = json.loads(out)
    assert code == 0
    assert {"python", "torch", "optuna", "mlflow", "transformers"} <= set(data["versions"])
    assert data["precisions"]["fp32"]["ok"] is True
    assert set(data["fp8_backends"]) == {"emulated", "torch", "te", "te-delayed", "torchao",
                                         "torchao-rowwise"}
    assert all(v["reason"] for v in data["fp8_backends"].values())
    code, out, _ = run_cli(["env"], capsys)
    assert code == 0 and "fp8 backends:" in out and "emulated" in out


def test_entry_point_one_line(tmp_path: Path) -> None:
    """The real process: exit code 2 and a single stderr line, no traceback."""
    proc = subprocess.run([*CLI, "graph", str(MODELS / "build_raises.py")],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "hidden_size 30 is not divisible by 4 heads" in proc.stderr


def test_graph_fits_a_terminal() -> None:
    """The graph table was ~300 columns wide; in a terminal every line fits (cut
    at why_not, the last column), FLOPs read as 67.1M; a pipe gets every reason whole."""
    import pandas as pd

    from autoprec.cli.graph_cmd import _fit, _si

    frame = pd.DataFrame({"layer": ["a", "b"], "flops": [_si(67108864), _si(0)],
                          "why_not": ["fp8: in_features 100 not a multiple of 16 " * 5, ""]})
    text = _fit(frame, 100)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "67.1M" in text and "--json gives every reason" in text
    assert frame["why_not"][0].rstrip() in _fit(frame, None)


def _offloaded(folder: Path):  # noqa: ANN202
    """A model whose weights accelerate offloaded to disk: every parameter on ``meta``."""
    import torch

    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return accelerate.disk_offload(net, str(folder), execution_device="cpu")


@pytest.mark.parametrize("entry", ["tune", "check", "evaluate", "save_pretrained"])
def test_an_offloaded_model_is_refused_in_one_line_naming_the_parameter(
        entry: str, tmp_path: Path) -> None:
    import torch

    import autoprec
    from autoprec.errors import InputError
    from autoprec.export import save_pretrained
    from autoprec.policy import Policy

    net = _offloaded(tmp_path / "offload")
    assert net(torch.randn(2, 8)).shape == (2, 4)  # it runs: accelerate loads as it goes
    calib = [torch.randn(4, 8)]
    pol = Policy(default="bf16")
    call = {
        "tune": lambda: autoprec.tune(net, calibration=calib, out=tmp_path / "p.yaml",
                                      progress=False),
        "check": lambda: autoprec.check(net, pol, calibration=calib),
        "evaluate": lambda: autoprec.evaluate(net, pol, calibration=calib),
        "save_pretrained": lambda: save_pretrained(net, pol, tmp_path / "ckpt"),
    }[entry]
    with pytest.raises(InputError) as info:
        call()
    msg = str(info.value)
    assert "parameter '0.weight' is on the meta device" in msg and "\n" not in msg, msg
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "ckpt").exists()
