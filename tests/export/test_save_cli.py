"""``autoprec save``: a checkpoint from model.py and a policy file; what a fused runtime
would reject is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoprec.policy import Policy
from tests.helpers import MODELS, run_cli

pytest.importorskip("compressed_tensors")

L = "model.layers"


def test_save_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pol = tmp_path / "p.yaml"
    Policy(default="bf16", form="deploy", layers={
        **{f"{L}.1.mlp.{n}": "fp8" for n in ("gate_proj", "up_proj")},
        f"{L}.0.mlp.down_proj": "fp32"}).save(pol)
    out = tmp_path / "ckpt"
    code, stdout, err = run_cli(["save", MODELS / "tiny_llama.py", "--policy", pol,
                                 "--out", out], capsys, quiet_warnings=True)
    assert code == 0, err
    assert "fp8: 2 layers" in stdout and "checkpoint on disk" in stdout
    assert "islands:" in stdout and f"{L}.0.mlp.down_proj (float32)" in stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["autoprec"]["islands"] == {f"{L}.0.mlp.down_proj": "float32"}


def test_a_mixed_fused_group_is_one_line_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pol = tmp_path / "p.yaml"
    Policy(default="bf16", form="deploy", layers={f"{L}.1.mlp.gate_proj": "fp8"}).save(pol)
    code, _, err = run_cli(["save", MODELS / "tiny_llama.py", "--policy", pol,
                            "--out", tmp_path / "ckpt"], capsys, quiet_warnings=True)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "gate_proj: fp8" in lines[0] and "up_proj: bf16" in lines[0]
    assert "--fuse-groups auto" in lines[0]


def test_save_refuses_a_model_that_is_not_hf(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pol = tmp_path / "p.yaml"
    Policy(default="bf16", form="deploy").save(pol)
    code, _, err = run_cli(["save", MODELS / "mlp.py", "--policy", pol, "--out",
                            tmp_path / "ckpt"], capsys, quiet_warnings=True)
    assert code == 2 and "PreTrainedModel" in err and err.strip().count("\n") == 0


@pytest.mark.parametrize("where", ["proc", "file", "model"])
def test_a_bad_out_is_one_line_exit_2_before_any_work(
        where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/proc (cannot be written), an existing file, the model file itself: refused before
    the model is built (a model.py that would raise if built shows none ran)."""
    pol = tmp_path / "p.yaml"
    Policy(default="bf16", form="deploy").save(pol)
    model = tmp_path / "model.py"
    model.write_text("raise SystemExit('model.py must not be imported')\n")
    taken = tmp_path / "taken.txt"
    taken.write_text("keep me\n")
    out = {"proc": Path("/proc/ck"), "file": taken, "model": model}[where]
    code, stdout, err = run_cli(["save", model, "--policy", pol, "--out", out], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"autoprec: error: --out {out}") and "Traceback" not in err
    assert stdout == "" and taken.read_text() == "keep me\n"
