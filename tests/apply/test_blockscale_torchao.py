"""The MXFP8 / NVFP4 emulation against torchao's reference quantisers, where torchao imports.

Skipped (with the import error) when torchao is absent — the project's venv has none.
Run in a venv with torchao (0.18.0 against torch 2.13.0 was used): every finite block
agrees bit for bit, except where the two differ on purpose (documented in
``autoprec.formats``):
- MX blocks whose amax is below 2**-118 use scale 2**-127: torchao divides by 2**-126
  there (its ``F32_MIN_NORMAL`` clamp, a noted workaround) and, in RCEIL mode, multiplies
  by 1.0 (Transformer Engine's ``exp2f_rcp`` convention), so their elements differ;
- MX blocks holding ±inf: NaN scale here (the spec reference, microxcaling), 2**120 (FLOOR)
  or 254 (RCEIL) in torchao;
- an all-zero NVFP4 tensor: zeros here, NaN in torchao (it divides by a zero tensor scale).
"""

from __future__ import annotations

import pytest
import torch

ao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
ao_nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
ao_cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
ao_k = pytest.importorskip("torchao.prototype.mx_formats.kernels")

from autoprec.formats import (  # noqa: E402
    dequantize_mx,
    dequantize_nvfp4,
    quantize_mx,
    quantize_nvfp4,
)
from autoprec.formats.elements import e2m1_values  # noqa: E402


def _data() -> torch.Tensor:
    """(256, 512): six decades across columns, outlier channels, a zero and a tiny block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g) * torch.logspace(-3, 3, 512)
    x[:, ::64] *= 100.0  # outlier channels
    x[3, :32] = 0.0  # an all-zero block
    x[4, 32:64] = torch.randn(32, generator=g) * 1e-37  # E8M0-clamped (amax < 2**-118)
    x[6, :] = torch.randn(512, generator=g) * 3e37  # near the top of fp32
    return x


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp8_matches_torchao_to_mx(mode: str) -> None:
    x = _data()
    ao_mode = getattr(ao_cfg.ScaleCalculationMode, mode.upper())
    s_ao, d_ao = ao_mx.to_mx(x, torch.float8_e4m3fn, 32, ao_mode)
    q = quantize_mx(x, scale_mode=mode)
    assert torch.equal(q.scale.view(torch.uint8), s_ao.view(torch.uint8).reshape(q.scale.shape))
    deq_ao = ao_mx.to_dtype(d_ao, s_ao, torch.float8_e4m3fn, 32, torch.float32)
    same = (dequantize_mx(q) == deq_ao).reshape(256, 16, 32).all(-1)  # per block
    differing = (~same).nonzero().tolist()
    assert differing == [[4, 1]]  # only the E8M0-clamped block (see the module docstring)


def test_nvfp4_matches_torchao_nvfp4_quantize() -> None:
    x = _data()[:, :256].contiguous()  # (256, 256); one per-tensor scale over all of it
    g = ao_nv.per_tensor_amax_to_scale(x.abs().amax())
    s_ao, d_ao = ao_nv.nvfp4_quantize(x, 16, g)
    q = quantize_nvfp4(x)
    assert torch.equal(q.tensor_scale, g)
    assert torch.equal(q.block_scale.view(torch.uint8),
                       s_ao.view(torch.uint8).reshape(q.block_scale.shape))
    v_ao = ao_k.f4_unpacked_to_f32(ao_k.unpack_uint4(d_ao)).reshape(q.codes.shape)
    assert torch.equal(e2m1_values(q.codes), v_ao)
    deq_ao = (v_ao.reshape(256, 16, 16) * (g * s_ao.float()).reshape(256, 16, 1)).reshape(256, 256)
    assert torch.equal(dequantize_nvfp4(q), deq_ao)


def test_known_differences_with_torchao() -> None:
    z = torch.zeros(2, 32)
    s_ao, _ = ao_nv.nvfp4_quantize(z, 16, ao_nv.per_tensor_amax_to_scale(z.abs().amax()))
    assert torch.isnan(s_ao.float()).all()  # torchao: NaN for an all-zero tensor
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(z)), z)  # here: zeros
    y = torch.ones(1, 32)
    y[0, 3] = float("inf")
    s_ao, _ = ao_mx.to_mx(y, torch.float8_e4m3fn, 32, ao_cfg.ScaleCalculationMode.FLOOR)
    assert s_ao.view(torch.uint8).item() == 247  # torchao: 2**120
    assert quantize_mx(y).scale.view(torch.uint8).item() == 255  # here: NaN (spec reference)
