"""tune's last stage writes the policy in the tune's form: the all-fp32 fallback of a tune
whose tuned plan is over budget too (a fp32 plan runs alike in both forms, so the file says
the form that was asked for)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from torch import nn

import autoprec


def _model_and_data() -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]:
    """Within budget in fp16 on the calibration data; on the eval data the inputs are 1e6
    times larger, past fp16's 65504: every fp16 plan's error is inf there, and fp32 is the
    fallback."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 16))
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(16, 64, generator=g) for _ in range(2)]
    held = [torch.randn(16, 64, generator=g) * 1e6 for _ in range(2)]
    return net, calib, held


def test_the_fp32_fallback_of_a_deploy_tune_is_written_in_the_deploy_form(
        tmp_path: Path) -> None:
    """The fp32 baseline row is the train form's (``fp32 (no autocast)``); the written
    file is the deploy tune's."""
    form = "deploy"
    net, calib, held = _model_and_data()
    out = tmp_path / "p.yaml"
    res = autoprec.tune(net, calibration=calib, eval=held, max_error=0.05, target="h100", batch_size=65536,
                        precisions=["fp16"],
                        trials=1, out=out, form=form, progress=False)
    assert res.policy.default == "fp32" and set(res.policy.layers.values()) <= {"fp32"}
    assert res.policy.provenance.get("trial") is None  # a baseline, not the tuned plan
    assert res.policy.form == form
    assert yaml.safe_load(out.read_text())["form"] == form
