"""experiments/train_digits.py runs end to end (--smoke: 1 epoch, 3 tune trials)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT

pytest.importorskip("sklearn")

SCRIPT = ROOT / "experiments" / "train_digits.py"


@pytest.mark.slow
def test_train_digits_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_digits", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    threads = torch.get_num_threads()  # main() sets 1
    try:
        spec.loader.exec_module(mod)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = mod.main(["--smoke", "--workdir", str(tmp_path)])
    finally:
        sys.modules.pop(spec.name, None)
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
