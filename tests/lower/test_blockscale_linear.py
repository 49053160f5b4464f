"""Block-scaled Linear backends (autoprec.lower.blockscale): eligibility, capability, the
emulated GEMM against a hand reference, gradients, and the real-kernel call contract."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.errors import CapabilityError
from autoprec.formats import BlockShapeError, fake_quant_mxfp8
from autoprec.formats.mx import MX_SCALE_MODE
from autoprec.lower.blockscale import (
    NoGradientRecipe,
    _quantize_weight,
    blockscale_capability,
    blockscaled_linear,
    reference_blockscaled_linear,
    scaled_mm_call,
)

FORMATS = ("mxfp8", "nvfp4")


class Conv1D(nn.Module):
    """HF GPT-2's Conv1D layout: weight (in, out), y = x @ W + b."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def _lin(k: int = 64, n: int = 32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


# --- capability ----------------------------------------------------------------------


def test_capability_emulated_everywhere_real_kernels_need_blackwell() -> None:
    for fmt in FORMATS:
        assert blockscale_capability(fmt, "emulated", "cpu")[0]
        ok, why = blockscale_capability(fmt, "torch", "cpu")
        assert not ok and "needs a CUDA device" in why
    ok, why = blockscale_capability("mxfp8", "te", "cpu")
    assert not ok and "unknown mxfp8 backend 'te'" in why
    with pytest.raises(CapabilityError, match="needs a CUDA device"):
        blockscaled_linear(_lin(), torch.randn(4, 64), "mxfp8", backend="torch")


# --- the emulated GEMM ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_linear_matches_the_hand_reference(fmt: str) -> None:
    lin = _lin(64, 32)
    x = torch.randn(2, 5, 64)  # (B, T, K): quantised along K only
    with torch.no_grad():
        y = blockscaled_linear(lin, x, fmt)
        ref = reference_blockscaled_linear(x, lin.weight, lin.bias, fmt)
    assert y.shape == (2, 5, 32) and y.dtype == torch.float32
    assert torch.equal(y, ref)
    exact = lin(x).detach()
    err = float((y - exact).norm() / exact.norm())
    assert err < {"mxfp8": 0.08, "nvfp4": 0.25}[fmt]  # e4m3 ~3%, e2m1 ~10% per operand


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_dtype_follows_input_and_autocast(fmt: str) -> None:
    lin = _lin()
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert blockscaled_linear(lin, x.bfloat16(), fmt).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = blockscaled_linear(lin, x, fmt)
        assert y.dtype == torch.bfloat16
        # the block-scaled arithmetic is explicit: autocast does not re-round the operands
        ref = reference_blockscaled_linear(x, lin.weight, lin.bias, fmt).bfloat16()
        assert torch.equal(y, ref)


def test_conv1d_and_no_bias() -> None:
    torch.manual_seed(0)
    c = Conv1D(64, 32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        y = blockscaled_linear(c, x, "mxfp8")
        assert torch.equal(y, reference_blockscaled_linear(x, c.weight.t(), c.bias, "mxfp8"))
        lin = _lin(bias=False)
        assert torch.equal(blockscaled_linear(lin, x, "nvfp4"),
                           reference_blockscaled_linear(x, lin.weight, None, "nvfp4"))


def test_weight_cache_follows_weight_updates() -> None:
    lin = _lin()
    x = torch.randn(4, 64)
    with torch.no_grad():
        y1 = blockscaled_linear(lin, x, "mxfp8")
        lin.weight.mul_(2.0)  # bumps the version: the cached quantised weight is stale
        y2 = blockscaled_linear(lin, x, "mxfp8")
        assert torch.equal(y2, reference_blockscaled_linear(x, lin.weight, lin.bias, "mxfp8"))
        assert not torch.equal(y1, y2)
        y3 = blockscaled_linear(lin, x, "nvfp4")  # another format: not the mxfp8 cache
        assert torch.equal(y3, reference_blockscaled_linear(x, lin.weight, lin.bias, "nvfp4"))


def test_k_not_divisible_is_a_block_shape_error() -> None:
    with pytest.raises(BlockShapeError, match="in_features 48 not a multiple of the block size 32"):
        blockscaled_linear(nn.Linear(48, 32), torch.randn(2, 48), "mxfp8")
    with pytest.raises(ValueError):
        blockscaled_linear(nn.Linear(24, 32), torch.randn(2, 24), "nvfp4")


# --- gradients -----------------------------------------------------------------------


def test_mxfp8_backward_requantises_along_each_gemm_reduction_dim() -> None:
    lin = _lin(64, 32)
    x = torch.randn(40, 64, requires_grad=True)  # M = 40: the wgrad GEMM pads M to 64
    y = blockscaled_linear(lin, x, "mxfp8")
    gy = torch.randn_like(y)
    y.backward(gy)

    def q_along(t: torch.Tensor) -> torch.Tensor:  # MXFP8 along the last dim, zero-padded
        pad = (-t.shape[-1]) % 32
        return fake_quant_mxfp8(F.pad(t, (0, pad)), MX_SCALE_MODE)[..., : t.shape[-1]]

    w, xd = lin.weight.detach(), x.detach()
    gx = q_along(gy) @ q_along(w.t()).t()  # dX = dY W, blocks along N
    gw = q_along(gy.t()) @ q_along(xd.t()).t()  # dW = dY^T X, blocks along M
    assert torch.equal(x.grad, gx)
    assert torch.equal(lin.weight.grad, gw)
    assert torch.equal(lin.bias.grad, gy.sum(0))
    # and close to the exact gradients (two e4m3 operands, ~4% each)
    exact_gx, exact_gw = gy @ w, gy.t() @ xd
    assert float((x.grad - exact_gx).norm() / exact_gx.norm()) < 0.08
    assert float((lin.weight.grad - exact_gw).norm() / exact_gw.norm()) < 0.08


def test_nvfp4_inference_gemm_backward_raises_a_clear_error() -> None:
    """The 1x16-weight inference GEMM has no backward; training takes the recipe's backend."""
    lin = _lin()
    y = blockscaled_linear(lin, torch.randn(4, 64), "nvfp4")
    assert y.requires_grad  # the weight is a parameter
    with pytest.raises(NoGradientRecipe, match="inference GEMM .* is forward-only: training "
                                               "runs NVIDIA's NVFP4 recipe"):
        y.sum().backward()
    assert issubclass(NoGradientRecipe, CapabilityError)


# --- real kernels --------------------------------------------------------------------


def _fake_cuda(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device="cuda")
    if isinstance(obj, list):
        return [_fake_cuda(v) for v in obj]
    return obj


@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_mm_call_passes_torch_own_shape_checks(fmt: str) -> None:
    """The F.scaled_mm arguments built for the real kernel satisfy torch 2.13's checks
    (``_check_scaled_mm_sizes_v2``, run on fake CUDA tensors: shapes and dtypes only, no
    numerics and no GPU), and a wrong scale size is refused by the same checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(112, 256), torch.randn(48, 256)  # M = 112 (padded scales), N = 48
    args, kwargs = scaled_mm_call(_quantize_weight(x, fmt, "torch"),
                                  _quantize_weight(w, fmt, "torch"), fmt, torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = F.scaled_mm(*_fake_cuda(list(args)), **kwargs)
    assert tuple(y.shape) == (112, 48) and y.dtype == torch.bfloat16
    bad = list(args)
    bad[2] = bad[2][:-4] if fmt == "mxfp8" else [bad[2][0][:-4], bad[2][1]]
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError):
        F.scaled_mm(*_fake_cuda(bad), **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_real_kernel_matches_the_emulation(fmt: str) -> None:
    ok, why = blockscale_capability(fmt, "torch")
    if not ok:
        pytest.skip(why)
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).cuda()
    x = torch.randn(100, 256, device="cuda")
    with torch.no_grad():
        y = blockscaled_linear(lin, x, fmt, backend="torch")
        ref = reference_blockscaled_linear(x, lin.weight, lin.bias, fmt)
    # same quantised operands, fp32 accumulation in another order
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
