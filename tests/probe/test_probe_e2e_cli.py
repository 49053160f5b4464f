"""Which pairs get end-to-end runs, and the ``autoprec probe`` command."""

from __future__ import annotations

import json
import textwrap

import pandas as pd
import pytest

from autoprec.errors import InputError
from autoprec.probe.e2e import choose
from autoprec.probe.layers import ProbeLayer
from tests.helpers import run_cli


def _layers() -> list[ProbeLayer]:
    return [ProbeLayer(f"l{i}", None, "linear", ("bf16", "fp16"),  # type: ignore[arg-type]
                       {"fp8": "fp8: nope"}) for i in range(3)]


def test_auto_measures_only_ambiguous_estimates_closest_first():
    est = {("l0", "bf16"): 0.011, ("l0", "fp16"): 1e-4, ("l1", "bf16"): 0.003,
           ("l1", "fp16"): 0.5, ("l2", "bf16"): 0.02, ("l2", "fp16"): 0.009}
    todo = choose("auto", _layers(), est, hard={("l2", "bf16")}, budget=0.01,
                  has_metric=False)
    assert todo == [("l0", "bf16"), ("l2", "fp16")]  # within 2x of the budget, not hard
    assert choose("auto", _layers(), est, set(), 0.01, False, band=4.0) == [
        ("l0", "bf16"), ("l2", "fp16"), ("l2", "bf16"), ("l1", "bf16")]
    assert choose("auto", _layers(), est, set(), 0.01, False, limit=1) == [("l0", "bf16")]
    assert choose("none", _layers(), est, set(), 0.01, False) == []
    assert len(choose("all", _layers(), est, set(), 0.01, False)) == 6
    # with a metric: the largest estimates, precision by precision
    assert set(choose("auto", _layers(), est, set(), 0.01, True, limit=2)) == {
        ("l2", "bf16"), ("l1", "fp16")}


def test_explicit_lists_and_errors():
    est: dict = {}
    assert choose(["l1"], _layers(), est, set(), 0.01, False) == [("l1", "bf16"), ("l1", "fp16")]
    assert choose([("l2", "fp16")], _layers(), est, set(), 0.01, False) == [("l2", "fp16")]
    with pytest.raises(InputError, match="not a probed layer"):
        choose(["zz"], _layers(), est, set(), 0.01, False)
    with pytest.raises(InputError, match="fp8: nope"):
        choose([("l0", "fp8")], _layers(), est, set(), 0.01, False)
    with pytest.raises(InputError, match="expected auto, all, none"):
        choose("some", _layers(), est, set(), 0.01, False)


MODEL_PY = textwrap.dedent('''
    import torch
    from torch import nn

    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 10))

    def calibration_data():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(4, 16, generator=g)]

    def loss(outputs, batch):
        return outputs.pow(2).mean()
''')


def test_cli_probe_table_csv_and_json(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(MODEL_PY)
    out = tmp_path / "t.csv"
    code, printed, err = run_cli(["probe", model, "--precisions", "bf16,fp8", "--out", out,
                                  "--quiet"], capsys)
    assert code == 0, err
    assert "fp8: out_features 10 not a multiple of 16" in printed
    assert "forward-pass equivalents" in printed
    df = pd.read_csv(out)
    assert {"layer", "precision", "local_error", "e2e_error", "reason"} <= set(df.columns)
    assert set(df.precision) == {"bf16", "fp8"} and len(df) == 4
    code, printed, err = run_cli(["probe", model, "--precisions", "bf16", "--e2e", "none",
                                  "--json"], capsys)
    assert code == 0, err
    doc = json.loads(printed)
    assert doc["model"] == tmp_path.name  # model.py is named after its folder
    assert {r["layer"] for r in doc["rows"]} == {"0", "2"}


def test_cli_bad_precisions_exit_2_one_line(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(MODEL_PY)
    code, _, err = run_cli(["probe", model, "--precisions", "fp16,fp7"], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "unknown precision 'fp7'" in err
    code, _, err = run_cli(["probe", model, "--e2e", "sometimes"], capsys)
    assert code == 2 and "--e2e" in err
