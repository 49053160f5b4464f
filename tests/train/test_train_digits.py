"""benchmarks/train_digits.py runs end to end (--smoke: 1 epoch, 3 tune trials)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")



@pytest.mark.slow
def test_train_digits_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = importlib.import_module("benchmarks.train_digits")
    threads = torch.get_num_threads()  # main() sets 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = mod.main(["--smoke", "--workdir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "policy + GradScaler" in out and "no loss scaling" in out
    by = {(r.name, r.loss_factor): r for r in runs}
    small = 2.0**-17
    scaled, unscaled = by[("policy + GradScaler", small)], by[("policy, no loss scaling", small)]
    assert scaled.final_scale is not None and unscaled.final_scale is None
    # Without the scaler, a 2^-17 loss flushes fp16 gradients to zero; with it, far fewer.
    assert unscaled.flushed is not None and scaled.flushed is not None
    assert unscaled.flushed > 0.05 > scaled.flushed
