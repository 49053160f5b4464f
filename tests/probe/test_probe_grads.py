"""Gradient probes: loss effect, gradient error and fp16 gradient underflow."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec.probe import probe


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16)).eval()


def _batches(n: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def test_fp16_gradients_underflow_without_a_loss_scale():
    # dL/dy = 2y / numel * 1e-7 ~ 1e-9: below fp16's smallest subnormal (6e-8) -> 0;
    # times 2**16 ~ 7e-5: representable.
    def loss(out, batch):
        return out.pow(2).mean() * 1e-7

    table = probe(_linear(), _batches(), ["bf16", "fp16"], loss=loss, e2e="none",
                  progress=False)
    fp16, bf16 = table.row("0", "fp16"), table.row("0", "bf16")
    assert fp16.grad_underflow > 0.9 and fp16.grad_underflow_scaled < 0.05
    assert fp16.grad_error > 0.9  # the whole backward is lost ...
    assert fp16.grad_error_scaled < 0.01  # ... and GradScaler's 2**16 saves it
    assert bf16.grad_underflow == 0.0  # fp32's exponent range
    assert bf16.grad_error == pytest.approx(bf16.grad_error_scaled)
    assert 1e-4 < bf16.grad_error < 2e-2


def test_loss_effect_is_the_first_order_loss_change():
    model = _linear()
    c = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))

    def loss(out, batch):  # linear in the output: first order is exact
        return (out * c).sum()

    x = _batches()[0]
    table = probe(model, [x], ["bf16"], loss=loss, e2e="none", progress=False)
    with torch.no_grad():
        ref = loss(model(x), x)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            low = model[0](x).float()
        moved = loss(low, x)
    assert table.row("0", "bf16").loss_effect == pytest.approx(float((moved - ref).abs()),
                                                               rel=1e-4)


def test_no_loss_leaves_gradient_columns_empty():
    table = probe(_linear(), _batches(), ["bf16"], e2e="none", progress=False)
    r = table.row("0", "bf16")
    assert math.isnan(r.grad_error) and math.isnan(r.loss_effect)
    assert r.estimate_method == "jacobian"


def test_frozen_model_still_gets_estimates():
    model = _linear().requires_grad_(False)
    table = probe(model, _batches(2), ["bf16"], e2e="all", progress=False)
    r = table.row("0", "bf16")
    assert r.estimate_method == "jacobian"
    assert r.e2e_output_error / 2 < r.cheap_estimate < 2 * r.e2e_output_error
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())


def test_forward_without_grad_falls_back_to_local_error():
    def forward(model, batch):
        with torch.no_grad():
            return model(batch)

    table = probe(_linear(), _batches(), ["bf16"], forward=forward, e2e="none",
                  progress=False)
    r = table.row("0", "bf16")
    assert r.estimate_method == "local" and r.cheap_estimate == r.local_error
