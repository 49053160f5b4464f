"""NVFP4 training of a Linear: the recipe's three GEMMs as an autograd.Function
(autoprec.lower.nvfp4_train), against a hand reference and against fp32."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from autoprec.device.capability import blockscale_capability
from autoprec.formats.nvfp4 import dequantize_nvfp4
from autoprec.formats.nvfp4_train import fake_quant_nvfp4_1d, quantize_nvfp4_2d
from autoprec.lower.backends import linear
from autoprec.lower.nvfp4_train import (
    RNG_ATTR,
    SR_SEED,
    WEIGHT_ATTR,
    nvfp4_train_linear,
    reference_nvfp4_train_grads,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _lin(k: int = 64, n: int = 32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n)


def test_the_three_gemms_are_the_recipes_bit_for_bit() -> None:
    lin = _lin()
    x = torch.randn(2, 16, 64, requires_grad=True)  # M = 32 tokens
    y = nvfp4_train_linear(lin, x)
    gy = torch.randn_like(y)
    y.backward(gy)
    ry, rdx, rdw = reference_nvfp4_train_grads(
        x.detach().reshape(32, 64), lin.weight.detach(), gy.reshape(32, 32),
        torch.Generator().manual_seed(SR_SEED))
    assert torch.equal(y.detach().reshape(32, 32), ry + lin.bias.detach())
    assert torch.equal(x.grad.reshape(32, 64), rdx)
    assert torch.equal(lin.weight.grad, rdw)
    assert torch.equal(lin.bias.grad, gy.reshape(32, 32).sum(0))
    # the forward: X along K round-to-nearest, W in 16x16 tiles (not the 1x16 inference GEMM)
    wq = dequantize_nvfp4(quantize_nvfp4_2d(lin.weight.detach()))
    assert torch.equal(ry, fake_quant_nvfp4_1d(x.detach().reshape(32, 64)) @ wq.t())


def test_gradients_of_a_linear_are_close_to_fp32_and_the_rounding_is_unbiased() -> None:
    """One step's gradients within the 4-bit error (two E2M1 operands, ~10% each); dgrad's
    mean over many backward passes approaches dY W_q (stochastic rounding: unbiased), which
    a round-to-nearest or a wrongly scaled dY would not."""
    lin, ref = _lin(), _lin()
    x = torch.randn(64, 64)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(gy := torch.randn(64, 32))
    dxs = []
    for _ in range(64):
        lin.zero_grad()
        xl = x.clone().requires_grad_(True)
        nvfp4_train_linear(lin, xl).backward(gy)
        dxs.append(xl.grad)
    assert _rel(lin.weight.grad, ref.weight.grad) < 0.25
    assert _rel(dxs[-1], xr.grad) < 0.25
    assert torch.equal(lin.bias.grad, ref.bias.grad)
    # dgrad's expectation: dY (stochastic, unbiased) times the quantised W
    wq = dequantize_nvfp4(quantize_nvfp4_2d(lin.weight.detach()))
    mean = torch.stack(dxs).mean(0)
    assert _rel(mean, gy @ wq) < 0.35 * _rel(dxs[-1], gy @ wq)
    assert not torch.equal(dxs[0], dxs[1])  # a fresh draw each backward


def test_gradients_of_a_tiny_mlp_follow_fp32() -> None:
    """A 3-layer MLP, every Linear in the recipe: each parameter's gradient within 45% of
    fp32's and pointing the same way (cosine > 0.9; measured over seeds 0-2: at most 0.35
    and at least 0.94, the first layer's, whose gradient went through three 4-bit dgrads).
    A broken wgrad (the transform on one operand) is off by more than 100%."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                        nn.Linear(64, 32))
    ref = copy.deepcopy(mlp)
    x, t = torch.randn(48, 32), torch.randn(48, 32)
    nn.functional.mse_loss(ref(x), t).backward()
    h = x
    for m in mlp:
        h = nvfp4_train_linear(m, h) if isinstance(m, nn.Linear) else m(h)
    nn.functional.mse_loss(h, t).backward()
    for (name, p), q in zip(mlp.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 0.45, name
        cos = float(torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0))
        assert cos > 0.9, (name, cos)


def test_odd_token_counts_pad_and_the_weight_is_requantised_after_a_step() -> None:
    lin = _lin()
    x = torch.randn(3, 7, 64, requires_grad=True)  # 21 tokens: padded to 32 inside
    y = nvfp4_train_linear(lin, x)
    assert y.shape == (3, 7, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape and bool(torch.isfinite(lin.weight.grad).all())
    assert _rel(y.detach(), lin(x).detach()) < 0.2
    key = lin.__dict__[WEIGHT_ATTR][0]
    torch.optim.SGD(lin.parameters(), lr=0.1).step()
    nvfp4_train_linear(lin, x)
    assert lin.__dict__[WEIGHT_ATTR][0] != key  # the weight's version moved
    assert isinstance(lin.__dict__[RNG_ATTR], torch.Generator)


def test_the_backend_dispatch_and_its_capability() -> None:
    lin = _lin()
    x = torch.randn(32, 64)
    assert torch.equal(linear(lin, x, "nvfp4", "train-emulated"), nvfp4_train_linear(lin, x))
    ok, why = blockscale_capability("nvfp4", "train-emulated", "cpu")
    assert ok and why.startswith("nvfp4 training recipe (train-emulated)")
    ok, why = blockscale_capability("nvfp4", "train-torch", "cpu")
    assert not ok and "needs a CUDA device" in why
    with pytest.raises(ValueError, match="unknown nvfp4 training backend 'te'"):
        nvfp4_train_linear(lin, x, "te")


_REAL = blockscale_capability("nvfp4", "train-torch")


@pytest.mark.skipif(not _REAL[0], reason=_REAL[1])
def test_real_nvfp4_kernels_match_the_emulation() -> None:  # pragma: no cover - SM >= 10
    lin = _lin().cuda()
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    y_ref = nvfp4_train_linear(lin, x, "train-emulated")
    y = nvfp4_train_linear(lin, x, "train-torch")
    assert _rel(y, y_ref) < 1e-5


def _torchao_nvfp4_training() -> tuple[bool, str]:
    """torchao's NVFP4Linear runs Triton kernels on CUDA SM >= 10.0 only."""
    name = "torchao.prototype.moe_training.nvfp4_training.nvfp4_training"
    if importlib.util.find_spec("torchao") is None:
        return False, "torchao is not installed"
    if importlib.util.find_spec("triton") is None:
        return False, "torchao's NVFP4 training runs Triton kernels: triton is not installed"
    ok, why = _REAL
    if not ok:
        return False, f"torchao's NVFP4 training (Triton) needs CUDA SM >= 10.0: {why}"
    return importlib.util.find_spec(name) is not None, f"{name} not found"


_AO = _torchao_nvfp4_training()


@pytest.mark.skipif(not _AO[0], reason=_AO[1])
def test_torchao_nvfp4_training_agrees() -> None:  # pragma: no cover - SM >= 10
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False).cuda()
    ao = NVFP4Linear.from_linear(copy.deepcopy(lin).to(torch.bfloat16))
    x = torch.randn(256, 256, device="cuda")
    ours = nvfp4_train_linear(lin, x)
    theirs = ao(x.to(torch.bfloat16)).float()
    assert _rel(ours, theirs) < 0.05  # the same recipe; its input rounded to bf16 first


def _te_nvfp4() -> tuple[bool, str]:
    """Transformer Engine's NVFP4BlockScaling recipe runs on CUDA SM >= 10.0."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "transformer_engine is not installed (pip install 'autoprec[fp8]')"
    ok, why = _REAL
    return (True, "") if ok else (False, f"TE's NVFP4 recipe needs CUDA SM >= 10.0: {why}")


_TE = _te_nvfp4()


@pytest.mark.skipif(not _TE[0], reason=_TE[1])
def test_transformer_engine_nvfp4_recipe_agrees() -> None:  # pragma: no cover - SM >= 10
    """TE's te.Linear under NVFP4BlockScaling: the forward within the two implementations'
    rounding, the gradients (stochastic rounding draws differ) as close to each other as
    each is to fp32."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import NVFP4BlockScaling

    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False).cuda()
    te_lin = te.Linear(256, 256, bias=False, params_dtype=torch.float32).cuda()
    with torch.no_grad():
        te_lin.weight.copy_(lin.weight)
    x = torch.randn(256, 256, device="cuda")
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = nvfp4_train_linear(lin, xa)
    with te.fp8_autocast(enabled=True, fp8_recipe=NVFP4BlockScaling()):
        theirs = te_lin(xb)
    assert _rel(ours, theirs.float()) < 0.05
    gy = torch.randn_like(ours)
    ours.backward(gy)
    theirs.backward(gy)
    exact = gy.t() @ x
    assert _rel(lin.weight.grad, te_lin.weight.grad) < 2 * _rel(te_lin.weight.grad, exact)
