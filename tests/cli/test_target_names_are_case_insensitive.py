"""`--target CPU` is `--target cpu`: one policy file, one `device:`, one plan (it used to
tune a second time into policies/<name>-CPU.yaml with `device: CPU`)."""

from __future__ import annotations

import json
from pathlib import Path

from autoprec.device.targets import canonical_target, device_type
from autoprec.policy import load_policy
from autoprec.tuning.config import TuneConfig
from tests.helpers import TRAP
from tests.helpers import run_cli as run


def test_target_names_are_read_in_lower_case() -> None:
    assert canonical_target(" H100 ") == "h100" and canonical_target("CPU") == "cpu"
    assert device_type("CPU") == "cpu" and device_type("H100") == "cuda"
    cfg = TuneConfig(max_error=0.01, target="CPU", trials=1, out="p.yaml",
                     progress=False).validated()
    assert cfg.pricing.target == "cpu"


def test_upper_case_target_tunes_the_same_file_device_and_plan(tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "trap.py"
    model.write_text(TRAP.read_text())
    tune = ["tune", model, "--no-track", "--quiet", "--trials", "2", "--batch-size", "4096"]
    code, out, err = run([*tune, "--target", "H100"], capsys)
    assert code == 0, err
    written = sorted(p.name for p in (tmp_path / "policies").glob("*.yaml"))
    assert written == ["trap-h100.yaml"], written
    upper = load_policy(tmp_path / "policies" / "trap-h100.yaml")
    assert upper.target_device == "h100" and "on h100" in out
    code, _, err = run([*tune, "--target", "h100"], capsys)
    assert code == 0, err
    lower = load_policy(tmp_path / "policies" / "trap-h100.yaml")
    assert (lower.default, lower.layers) == (upper.default, upper.layers)
    assert lower.provenance["study"] == upper.provenance["study"]  # one study, joined
    code, out, err = run(["eval", model, "--policy", "policies/trap-h100.yaml",
                          "--target", "H100", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["target"] == "h100"
