"""Every speed figure says the batch size it is for and where that came from (the default,
the calibration batch, decides the answer on a GPU profile)."""

from __future__ import annotations

import json
from pathlib import Path

from autoprec.evaluation.json_fields import batch_size_from, batch_size_words
from tests.helpers import TRAP
from tests.helpers import run_cli as run


def test_batch_size_sources_are_named() -> None:
    assert batch_size_from(256) == "--batch-size"
    assert batch_size_from(None, 4096) == "policy"
    assert batch_size_from(None, None) == "calibration batch"
    assert batch_size_words(256, "--batch-size") == "batch size 256 (--batch-size)"
    assert "--batch-size N" in batch_size_words(8, "calibration batch")


def test_tune_eval_and_check_say_the_batch_size_and_its_source(tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["tune", TRAP, "--no-track", "--quiet", "--trials", "2",
                          "--out", "p.yaml"], capsys)
    assert code == 0, err
    summary = next(line for line in out.splitlines() if line.startswith("error "))
    assert ("on h100 at batch size 32 (the calibration batch's; give the deployment's with "
            "--batch-size N)") in summary, summary
    code, out, err = run(["eval", TRAP, "--policy", "p.yaml"], capsys)
    assert code == 0, err
    assert "at batch size 32 (the policy's target.batch_size)" in out, out
    code, out, err = run(["eval", TRAP, "--policy", "p.yaml", "--batch-size", "64",
                          "--json"], capsys)
    assert code == 0, err
    s = json.loads(out)
    assert (s["batch_size"], s["batch_size_from"]) == (64, "--batch-size")
    code, out, err = run(["check", TRAP, "--policy", "p.yaml", "--json"], capsys)
    assert code == 0, err
    s = json.loads(out)
    assert (s["batch_size"], s["batch_size_from"]) == (32, "policy")
    code, out, err = run(["check", TRAP, "--policy", "p.yaml", "--batch-size", "128"], capsys)
    assert code == 0, err
    assert "target h100 at batch size 128 (--batch-size)" in out, out
