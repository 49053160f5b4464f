"""One target, one price: tune, ``eval`` and ``check`` price a policy for the local CPU
from the same source (this machine's calibration and the model's ops timed here).

Last round ``check`` read the stored ``cpu`` profile where ``eval`` and tune used this
machine's calibration: 2.59x against 3.01x for one policy, target and batch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autoprec.evaluation.check import check
from autoprec.policy import load_policy
from autoprec.tuning.tune import tune
from tests.helpers import MODELS, run_cli

FIXTURE = MODELS / "mlp.py"


def test_tune_eval_and_check_print_one_price_for_the_local_cpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model.py"
    shutil.copy(FIXTURE, model)
    out = tmp_path / "policies" / "mlp-cpu.yaml"
    tune(model, max_error=0.05, target="cpu", precisions=["bf16", "fp16"], trials=4,
         out=out, progress=False)
    pol = load_policy(out)
    tuned = float(pol.metrics["est_speedup"])
    assert list((out.parent / ".autoprec" / "calibration").glob("ops-*.json"))

    code, text, err = run_cli(["eval", model, "--policy", out, "--json"], capsys)
    assert code == 0, err
    evaluated = json.loads(text)["est_speedup"]

    got = check(model, out)
    assert any("cpu profile calibrated on this machine" in n for n in got.notes), got.notes
    assert got.est_speedup == pytest.approx(evaluated, rel=1e-9)
    assert got.est_speedup == pytest.approx(tuned, rel=1e-3)  # the policy keeps 4 digits

    # without this machine's timings (another folder), check says it priced the stored
    # profile, measured on another machine
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(out, other / "p.yaml")
    far = check(model, other / "p.yaml")
    assert any("measured on another machine" in n for n in far.notes), far.notes
