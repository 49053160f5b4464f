"""``ScoringContext``: what tune's search scores and audits a policy on, as one value.

tune's rows (baselines, a 16-bit model's own rows, the training recipes) are scored and
audited through it exactly as the search's plans: the policy applied for the scoring target
(fp8 emulated), the eval data run only where it is separate and the calibration error is
within budget, an error already known (the search's own score) not run again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec.evaluation.scoring_context import SCORING_FP8_BACKEND, ScoringContext
from autoprec.policy import Policy
from autoprec.pricing.target import resolve_target
from autoprec.trace.graph import fingerprint
from autoprec.workload.loading import ModelSpec
from autoprec.workload.scoring import reference


def _context(tmp_path: Path, separate_eval: bool) -> ScoringContext:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    calib = [torch.randn(8, 16) for _ in range(2)]
    evals = [torch.randn(8, 16) for _ in range(2)]
    spec = ModelSpec(path=None, name="mlp", build_model=lambda: net,
                     calibration_data=lambda: calib)
    target = resolve_target("cpu", form="deploy", cache_dir=tmp_path)
    return ScoringContext.build(
        spec=spec, model=net, batches=calib, ref=reference(spec, net, calib, "(calibration)"),
        target=target, eval_batches=evals if separate_eval else None,
        eval_ref=reference(spec, net, evals, "of eval_data") if separate_eval else None)


def test_built_once_from_the_tunes_target(tmp_path: Path) -> None:
    ctx = _context(tmp_path, separate_eval=False)
    assert ctx.fingerprint == fingerprint(ctx.model)
    assert ctx.scoring.fp8_backend == SCORING_FP8_BACKEND
    assert ctx.scoring.name == ctx.target.name and ctx.form == ctx.target.form == "deploy"
    pol = ctx.policy("bf16", {"0": "fp32"}, "train")
    assert (pol.default, pol.layers, pol.form) == ("bf16", {"0": "fp32"}, "train")
    assert pol.model == {"fingerprint": ctx.fingerprint}
    assert pol.target == {"device": ctx.target.name}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.fingerprint = "x"  # type: ignore[misc]


def test_errors_as_the_search_scores(tmp_path: Path) -> None:
    ctx = _context(tmp_path, separate_eval=True)
    fp32, bf16 = Policy(default="fp32"), Policy(default="bf16")
    assert ctx.errors(fp32, budget=1.0) == (0.0, 0.0)
    calib, evl = ctx.errors(bf16, budget=1.0)
    assert 0.0 < calib < 1.0 and evl is not None and evl > 0.0
    assert calib == ctx.error(bf16) and evl == ctx.error(bf16, on_eval=True)
    assert ctx.errors(bf16, budget=calib / 2) == (calib, None)  # over budget: no eval run
    assert ctx.errors(bf16, budget=1.0, known=(0.5, 0.25)) == (0.5, 0.25)  # not run again
    assert ctx.audit(bf16) == []
    # the eval data is the calibration data: no eval error
    same = _context(tmp_path, separate_eval=False)
    assert same.errors(bf16, budget=1.0)[1] is None
