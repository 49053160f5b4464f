"""benchmarks/gpu_train_step.py runs on this CPU at toy sizes and writes its table; the
rows that need fp8 kernels are skipped with the capability check's reason."""

from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch

from autoprec.device.capability import torchao_fp8_kernels
from tests.helpers import ROOT

pytest.importorskip("torchao.float8")


def _script():
    spec = importlib.util.spec_from_file_location(
        "gpu_train_step", ROOT / "benchmarks" / "gpu_train_step.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_train_step"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _table(path) -> dict[str, dict[str, str]]:
    import csv

    with open(path / "train_step.csv") as f:
        return {r["row"]: r for r in csv.DictReader(f)}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the rows a CPU skips")
def test_cpu_run_times_the_one_liners_and_skips_fp8_with_the_reason(tmp_path) -> None:
    mod = _script()
    assert mod.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = _table(tmp_path)
    assert list(rows) == ["fp32", "bf16 autocast", "fp16 autocast + scaler",
                          "fp8 torchao tensorwise", "fp8 torchao rowwise",
                          "plan: bf16 + fp8 blocks"]
    md = (tmp_path / "train_step.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| row"))
    assert [h.strip() for h in header.strip("|").split("|")] == mod.COLUMNS
    assert any(line.startswith("- device: cpu") for line in md)
    for name in ("fp32", "bf16 autocast", "fp16 autocast + scaler", "plan: bf16 + fp8 blocks"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert float(r["ms_per_step"]) > 0 and float(r["state_mib"]) > 0
        assert r["peak_mem_mib"] == "n/a"  # a CPU has no peak-memory counter
    assert float(rows["fp32"]["speedup_vs_fp32"]) == 1.0
    for name, backend in (("fp8 torchao tensorwise", "torchao"),
                          ("fp8 torchao rowwise", "torchao-rowwise")):
        assert rows[name]["status"] == "skipped"
        assert rows[name]["note"] == torchao_fp8_kernels(backend, "cpu")[1]
    # the plan runs as the train form picks here: the home-made emulation on a CPU
    assert rows["plan: bf16 + fp8 blocks"]["fp8_backend"] == "emulated"


def test_emulated_fp8_rows_and_a_policy_file(tmp_path) -> None:
    """--emulate-fp8 runs the torchao rows through its emulation (script check) and the
    plan through the torchao backend, audited; --policy times a written plan."""
    pol = tmp_path / "mine.yaml"
    pol.write_text("autoprec_policy: 1\ndefault: bf16\nlayers:\n  blocks.0.fc1: fp8\n"
                   "  head: fp32\n")
    mod = _script()
    out = tmp_path / "out"
    assert mod.main(["--tiny", "--device", "cpu", "--out", str(out), "--emulate-fp8",
                     "--policy", str(pol), "--only",
                     "fp32,fp8 torchao tensorwise,plan: bf16 + fp8 blocks,policy: mine.yaml"]
                    ) == 0
    rows = _table(out)
    assert list(rows) == ["fp32", "fp8 torchao tensorwise", "plan: bf16 + fp8 blocks",
                          "policy: mine.yaml"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["fp8 torchao tensorwise"]["note"] == "8 Float8Linear (tensorwise, emulate=True)"
    plan = rows["plan: bf16 + fp8 blocks"]
    assert plan["fp8_backend"] == "torchao"
    assert "audit: 8 fp8 leaves ran fprop/dgrad/wgrad in fp8 through torchao" in plan["note"]
    assert "audit: 1 fp8 leaves" in rows["policy: mine.yaml"]["note"]


def test_time_limit_and_bad_input(tmp_path, capsys) -> None:
    mod = _script()
    assert mod.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--time-limit", "0",
                     "--only", "fp32,bf16 autocast"]) == 0
    rows = _table(tmp_path)  # written even though nothing ran
    assert {r["status"] for r in rows.values()} == {"skipped"}
    assert all("--time-limit" in r["note"] for r in rows.values())
    assert mod.main(["--tiny", "--policy", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


def test_the_script_is_a_model_py_for_tune() -> None:
    """`autoprec tune benchmarks/gpu_train_step.py --form train` loads it as a model.py."""
    from autoprec.workload.loading import load_model_file

    spec = load_model_file(ROOT / "benchmarks" / "gpu_train_step.py")
    mod = _script()
    batches = spec.calibration_batches()
    assert [tuple(b.shape) for b in batches] == [(mod.DEFAULTS["batch"], mod.DEFAULTS["seq"])] * 2
    assert spec.loss is not None and spec.name == "gpu_train_step"
    tiny = mod.GPT(256, 64, 2, 2, 16)
    ids = batches[0][:2, :16] % 256
    assert spec.loss(spec.forward(tiny, ids), ids).ndim == 0


def test_the_tuned_row_tunes_for_training_then_times_the_plan(tmp_path) -> None:
    """--tune (a GPU's default): autoprec.tune --form train on the model here, its policy
    written beside the table and timed as a row with what tune found in its note."""
    mod = _script()
    out = tmp_path / "out"
    assert mod.main(["--tiny", "--device", "cpu", "--out", str(out), "--tune",
                     "--tune-seconds", "20", "--only", f"fp32,{mod.TUNED_ROW}"]) == 0
    rows = _table(out)
    assert list(rows) == ["fp32", mod.TUNED_ROW]
    tuned = rows[mod.TUNED_ROW]
    assert tuned["status"] == "ok", tuned["note"]
    assert float(tuned["ms_per_step"]) > 0 and tuned["note"].startswith("tuned in ")
    from autoprec.policy import load_policy

    assert load_policy(out / "tuned.yaml").form == "train"
