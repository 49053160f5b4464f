"""SensitivityTable at the boundary (frame, CSV, JSON) and the on-disk cache."""

from __future__ import annotations

import json
import math
import warnings

import pandas as pd
import pytest
import torch
from torch import nn

from autoprec.probe import CORE_COLUMNS, SensitivityTable, probe
from autoprec.probe.cache import cache_path


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).eval()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 16, generator=g)]


def test_frame_csv_json(known_table, tmp_path):
    df = known_table.to_frame()
    assert tuple(df.columns[: len(CORE_COLUMNS)]) == CORE_COLUMNS
    assert {"cheap_estimate", "grad_error", "loss_effect", "in_max_abs"} <= set(df.columns)
    assert len(df) == 16  # 4 layers x 4 precisions
    known_table.to_csv(tmp_path / "t.csv")
    back = pd.read_csv(tmp_path / "t.csv", keep_default_na=False)
    assert list(back.columns) == list(df.columns) and len(back) == 16
    # JSON has no inf/NaN: they round-trip as strings
    again = SensitivityTable.from_json(json.loads(known_table.dumps()))
    assert math.isinf(again.row("big", "fp16").local_error)
    assert again.hard_excluded() == known_table.hard_excluded()
    ranked = known_table.ranked()
    assert ranked.iloc[0]["hard"]  # hard exclusions first


def test_disallowed_precision_is_a_row_with_its_reason():
    table = probe(_model(), _batches(), ["bf16", "fp8"], e2e="none", progress=False)
    r = table.row("2", "fp8")  # 32 -> 10: out_features not a multiple of 16
    assert not r.allowed and r.hard and "out_features 10" in r.reason
    assert table.hard_excluded()[("2", "fp8")] == r.reason
    assert math.isinf(table.estimate("2", "fp8"))
    assert not table.row("0", "fp8").hard  # 16 -> 32 is fp8-eligible
    combined = table.combined_estimate({"0": "bf16", "2": "bf16"})
    assert combined == pytest.approx(math.hypot(table.estimate("0", "bf16"),
                                                table.estimate("2", "bf16")))
    with pytest.raises(KeyError, match="no probe row"):
        table.row("1", "bf16")


def test_cache_hit_miss_and_atomic_files(tmp_path):
    model, batches = _model(), _batches()
    first = probe(model, batches, ["bf16"], e2e="none", progress=False, cache_dir=tmp_path)
    assert first.meta["cached"] is False
    second = probe(model, batches, ["bf16"], e2e="none", progress=False, cache_dir=tmp_path)
    assert second.meta["cached"] is True
    pd.testing.assert_frame_equal(first.to_frame(), second.to_frame())
    assert [p.name for p in tmp_path.iterdir()] == [cache_path(tmp_path, first.meta["cache_key"]).name]
    # other precisions, other data or other weights: a different key
    other = probe(model, batches, ["fp16"], e2e="none", progress=False, cache_dir=tmp_path)
    assert other.meta["cached"] is False
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    changed = probe(model, batches, ["bf16"], e2e="none", progress=False, cache_dir=tmp_path)
    assert changed.meta["cached"] is False
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_corrupt_cache_file_is_ignored(tmp_path):
    model, batches = _model(), _batches()
    first = probe(model, batches, ["bf16"], e2e="none", progress=False, cache_dir=tmp_path)
    cache_path(tmp_path, first.meta["cache_key"]).write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = probe(model, batches, ["bf16"], e2e="none", progress=False, cache_dir=tmp_path)
    assert again.meta["cached"] is False
    assert any("unreadable probe cache" in str(w.message) for w in caught)
