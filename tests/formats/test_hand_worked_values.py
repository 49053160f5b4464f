"""fp8 e4m3 / e5m2 (per-tensor current scaling), MXFP8 and NVFP4 quantisation against
values worked out by hand from the format definitions; the arithmetic is beside each one.

The definitions (OCP 8-bit FP spec v1.0; OCP MX spec v1.0 tables 1 and 5, section 6.3;
NVIDIA's two-level NVFP4 recipe as Transformer Engine documents it):

- E4M3: bias 7, 3 mantissa bits, no inf, S.1111.111 NaN; max 1.75 * 2**8 = 448; smallest
  normal 2**-6, smallest subnormal 2**-9. Spacing 2**(e - 3) in [2**e, 2**(e+1)): 0.125 in
  [1, 2), 32 in [256, 448]. E5M2: bias 15, 2 mantissa bits, max 1.75 * 2**15 = 57344;
  spacing 4096 in [16384, 32768).
- Current scaling: s = fmax / amax(x); q = RNE(x * s) saturating; value q / s.
- MXFP8: per 32 along K one E8M0 power of two X (byte b: 2**(b - 127); 255 NaN) and E4M3
  elements V / X. The spec's X = 2**(floor(log2 amax_b) - 8); NVIDIA's "rceil"
  X = 2**ceil(log2(amax_b / 448)).
- NVFP4: E2M1 elements {0, 0.5, 1, 1.5, 2, 3, 4, 6} (codes 0..7, bit 3 the sign), an E4M3
  decode scale s_b per 16 along K, a fp32 tensor decode scale g = amax / (448 * 6):
  s_b = RNE_e4m3((amax_b / 6) / g), q = RNE_e2m1(x / (g s_b)), value q * g * s_b.

Ties go to the even code: for E4M3 the value whose last mantissa bit is 0, for E2M1 the
even code (1.25 -> 1 (code 2), 1.75 -> 2 (code 4), 2.5 -> 2, 3.5 -> 4, 5 -> 4).
"""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.formats.elements import E4M3, E5M2, e2m1_values, e8m0_to_float
from autoprec.formats.fp8 import dequantize_fp8, fake_quant_fp8, quantize_fp8
from autoprec.formats.mx import dequantize_mx, quantize_mx
from autoprec.formats.nvfp4 import dequantize_nvfp4, nvfp4_tensor_scale, quantize_nvfp4
from tests import reference_formats as ref


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- the grids themselves ----------------------------------------------------------------


def test_e4m3_grid_max_spacing_and_subnormals() -> None:
    g = ref.E4M3.grid  # the reference's grid, enumerated from bias and bit widths
    assert len(g) == 127 and g[-1] == 448.0 == 1.75 * 2**8  # codes 0x00..0x7E; 0x7F NaN
    assert g[1] == 2**-9 and g[8] == 2**-6  # smallest subnormal, smallest normal
    assert [g[i] for i in range(56, 65)] == [1 + k / 8 for k in range(8)] + [2.0]
    assert [g[i] for i in range(120, 127)] == [256 + 32 * k for k in range(7)]
    # torch's e4m3 decodes every finite byte to the same values
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert codes.tolist() == list(g)
    assert math.isnan(torch.tensor([0x7F], dtype=torch.uint8).view(E4M3).float().item())


def test_e5m2_and_e2m1_grids() -> None:
    assert ref.E5M2.max == 57344.0 == 1.75 * 2**15 and ref.E5M2.grid[1] == 2**-16
    assert ref.E2M1.grid == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_values(codes).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# --- fp8, per-tensor current scaling -----------------------------------------------------


def test_fp8_scale_is_448_over_amax_and_exact_values_round_trip() -> None:
    # amax 2 -> s = 448 / 2 = 224; 2 * 224 = 448, 1 * 224 = 224 = 1.75 * 2**7,
    # -0.5 * 224 = -112 = -1.75 * 2**6: all e4m3 values, so they come back exactly
    x = _t([2.0, 1.0, -0.5, 0.0])
    q, s = quantize_fp8(x, E4M3)
    assert s.item() == 224.0
    assert q.float().tolist() == [448.0, 224.0, -112.0, 0.0]
    assert dequantize_fp8(q, s).tolist() == [2.0, 1.0, -0.5, 0.0]


def test_fp8_e4m3_rounding_ties_to_even_and_spacing() -> None:
    # amax 448 -> s = 1: the values are rounded as they are
    x = _t([448.0,
            1.0625,  # 1 + 1/16: tie of 1.0 (mantissa 000) and 1.125 (001) -> 1.0
            1.1875,  # 1 + 3/16: tie of 1.125 (001) and 1.25 (010) -> 1.25
            1.2,  # nearest of 1.125, 1.25 (step 0.125 in [1, 2)) -> 1.25
            300.0,  # step 32 in [256, 448]: 288 (12 away), 320 (20 away) -> 288
            304.0,  # tie of 288 (mantissa 001) and 320 (010) -> 320
            -0.001,  # past half the smallest subnormal (2**-10 = 0.000977) -> -2**-9
            0.0009765625,  # exactly 2**-10: tie of 0 and 2**-9 -> 0
            0.01171875])  # 6 * 2**-9: a subnormal, exact
    got = fake_quant_fp8(x).tolist()
    assert got == [448.0, 1.0, 1.25, 1.25, 288.0, 320.0, -2**-9, 0.0, 0.01171875]


def test_fp8_e4m3_saturates_at_448_after_scaling() -> None:
    # amax 1 -> s = 448: x = 1 maps to 448 exactly; everything in between rounds on the
    # e4m3 grid scaled by 1/448: 0.6 * 448 = 268.8 -> 256 (step 32) -> 256 / 448 = 0.571...
    x = _t([1.0, 0.6, -1.0])
    q, s = quantize_fp8(x, E4M3)
    assert s.item() == 448.0 and q.float().tolist() == [448.0, 256.0, -448.0]
    assert fake_quant_fp8(x).tolist() == [1.0, _t([256 / 448]).item(), -1.0]


def test_fp8_e5m2_for_gradients() -> None:
    # amax 1 -> s = 57344; 0.3 * 57344 = 17203.2 -> 16384 (step 4096 in [16384, 32768));
    # 0.5 * 57344 = 28672 = 1.75 * 2**14 exact
    q, s = quantize_fp8(_t([1.0, 0.3, -0.5]), E5M2)
    assert s.item() == 57344.0 and q.float().tolist() == [57344.0, 16384.0, -28672.0]


def test_fp8_scale_is_one_correctly_rounded_division() -> None:
    """57344 / 2.296875 = 24966.0952...: the nearest fp32 is 24966.095703125. (Computed as
    57344 * (1 / 2.296875) it would be 24966.09375, one ulp below, and ties of a bf16
    gradient's few-bit values would then round the other way.)"""
    _, s = quantize_fp8(_t([2.296875, -1.0]), E5M2)
    assert s.item() == 24966.095703125
    _, s = quantize_fp8(_t([3.0]), E4M3)
    assert s.item() == _t([448 / 3]).item()


# --- MXFP8 -------------------------------------------------------------------------------


def _row(values: list[float], n: int = 32) -> torch.Tensor:
    return _t(values + [0.0] * (n - len(values))).reshape(1, n)


def _bytes(scale: torch.Tensor) -> list[int]:
    return scale.view(torch.uint8).flatten().tolist()


def test_mx_shared_exponent_per_32_spec_floor() -> None:
    # block 0: amax 1 -> X = 2**(floor(log2 1) - 8) = 2**-8, byte 127 - 8 = 119;
    # block 1: amax 1024 -> X = 2**(10 - 8) = 4, byte 129: one exponent per 32 elements
    x = torch.cat([_row([1.0, 0.01, -0.5]), _row([1024.0, 3.0])], dim=1)  # (1, 64)
    q = quantize_mx(x, scale_mode="floor")
    assert _bytes(q.scale) == [119, 129]
    assert e8m0_to_float(q.scale).flatten().tolist() == [2**-8, 4.0]
    # elements V / X: 1 * 256 = 256; 0.01 * 256 = 2.56 -> 2.5 (step 0.25 in [2, 4));
    # -0.5 * 256 = -128; 1024 / 4 = 256; 3 / 4 = 0.75 (exact)
    assert q.data.float()[0, [0, 1, 2, 32, 33]].tolist() == [256.0, 2.5, -128.0, 256.0, 0.75]
    out = dequantize_mx(q)[0, [0, 1, 2, 32, 33]].tolist()
    assert out == [1.0, 2.5 / 256, -0.5, 1024.0, 3.0]


def test_mx_spec_floor_saturates_and_rceil_does_not() -> None:
    # amax 500: floor -> X = 2**(8 - 8) = 1 and 500 saturates to 448 (the spec's clamp);
    # rceil -> X = 2**ceil(log2(500 / 448)) = 2**1, 500 / 2 = 250 -> 256 (step 16 in
    # [128, 256): 240 is 10 away, 256 is 6) -> 512
    x = _row([500.0, 100.0])
    floor, rceil = quantize_mx(x, scale_mode="floor"), quantize_mx(x, scale_mode="rceil")
    assert _bytes(floor.scale) == [127] and _bytes(rceil.scale) == [128]
    # 100 / 1 = 100 -> 96 (step 8 in [64, 128): 96 is 4 away, 104 is 4: a tie, 96 = 1.100b
    # has mantissa 100 (even), 104 = 1.101b odd) ; 100 / 2 = 50 -> 48 (tie of 48 and 52,
    # 48 even) -> 96
    assert dequantize_mx(floor)[0, :2].tolist() == [448.0, 96.0]
    assert dequantize_mx(rceil)[0, :2].tolist() == [512.0, 96.0]


def test_mx_zero_and_nan_blocks() -> None:
    x = torch.cat([_row([]), _row([float("nan"), 1.0])], dim=1)
    q = quantize_mx(x)
    assert _bytes(q.scale) == [0, 255]  # zero block: 2**-127; NaN block: the NaN scale
    out = dequantize_mx(q)
    assert (out[0, :32] == 0).all() and out[0, 32:].isnan().all()


# --- NVFP4 -------------------------------------------------------------------------------


def _nv_row() -> torch.Tensor:
    """Three blocks of 16 whose scales come out exact (amax 10.5 = 2688 * 2**-8: g = 2**-8).

    block 0: amax 10.5 -> s_b = (10.5 / 6) / 2**-8 = 448 (E4M3's max)
    block 1: amax 6    -> s_b = 1 / 2**-8 = 256: g * s_b = 1, the elements are rounded as
             they are
    block 2: amax 7.03125 -> (7.03125 / 6) * 256 = 300 -> E4M3 288 (step 32: 288 is 12 away)
    """
    b0 = [10.5, 1.75] + [0.0] * 14
    b1 = [6.0, 5.0, 3.5, 2.5, 1.25, 0.75, 0.25, -1.75, 0.1, -6.0, 2.0, 0.5] + [0.0] * 4
    b2 = [7.03125, -3.375] + [0.0] * 14
    return _t(b0 + b1 + b2).reshape(1, 48)


def test_nvfp4_tensor_and_block_scales() -> None:
    x = _nv_row()
    assert nvfp4_tensor_scale(x).item() == 2**-8  # 10.5 / (448 * 6)
    q = quantize_nvfp4(x)
    assert q.tensor_scale.item() == 2**-8
    assert q.block_scale.float().flatten().tolist() == [448.0, 256.0, 288.0]


def test_nvfp4_e2m1_elements_round_to_the_even_code() -> None:
    q = quantize_nvfp4(_nv_row())
    v = e2m1_values(q.codes)[0]
    # block 1, encode scale (1 / g) / s_b = 256 / 256 = 1:
    # 6 -> 6; 5 -> tie of 4 (code 6) and 6 (code 7) -> 4; 3.5 -> tie of 3 (5), 4 (6) -> 4;
    # 2.5 -> tie of 2 (4), 3 (5) -> 2; 1.25 -> 1; 0.75 -> tie of 0.5 (1), 1 (2) -> 1;
    # 0.25 -> tie of 0 (0), 0.5 (1) -> 0; -1.75 -> -2; 0.1 -> 0; -6; 2; 0.5
    assert v[16:28].tolist() == [6.0, 4.0, 4.0, 2.0, 1.0, 1.0, 0.0, -2.0, 0.0, -6.0, 2.0, 0.5]
    assert q.codes[0, 16:20].tolist() == [7, 6, 6, 4]
    assert q.codes[0, 23].item() == 8 | 4  # -2: sign bit 3, magnitude code 4
    out = dequantize_nvfp4(q)[0]
    assert out[16:28].tolist() == v[16:28].tolist()  # g * s_b = 2**-8 * 256 = 1


def test_nvfp4_block_max_saturates_after_the_e4m3_scale_rounds_down() -> None:
    out = dequantize_nvfp4(quantize_nvfp4(_nv_row()))[0]
    # block 0: g * s_b = 448 / 256 = 1.75; 10.5 / 1.75 = 6 -> 6 -> 10.5 (exact);
    # 1.75 / 1.75 = 1 -> 1.75
    assert out[:2].tolist() == [10.5, 1.75]
    # block 2: g * s_b = 288 / 256 = 1.125; 7.03125 / 1.125 = 6.25 saturates to 6 -> 6.75;
    # -3.375 / 1.125 = -3 -> -3.375
    assert out[32:34].tolist() == [6.75, -3.375]


def test_nvfp4_zero_block_takes_the_smallest_normal_e4m3_scale() -> None:
    x = torch.cat([_nv_row()[:, :16], torch.zeros(1, 16)], dim=1)
    q = quantize_nvfp4(x)
    assert q.block_scale.float().flatten().tolist() == [448.0, 2**-6]  # clamped up to 2**-6
    assert (dequantize_nvfp4(q)[0, 16:] == 0).all()


# --- the reference quantisers agree with autoprec's on random data ------------------------


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_autoprec_quantisers_match_the_definitions(scale: float) -> None:
    """The hand cases above are few; on random data every element of autoprec's fp8, MXFP8
    and NVFP4 quantisers equals the reference's (tests/reference_formats.py, written from
    the definitions, sharing no code with autoprec)."""
    from autoprec.formats.mx import fake_quant_mxfp8
    from autoprec.formats.nvfp4 import fake_quant_nvfp4

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * scale
    assert torch.equal(fake_quant_fp8(x), ref.fp8_current_scaling(x))
    assert torch.equal(fake_quant_fp8(x, E5M2), ref.fp8_current_scaling(x, ref.E5M2))
    assert torch.equal(fake_quant_mxfp8(x, "rceil"), ref.mxfp8(x))
    assert torch.equal(fake_quant_nvfp4(x), ref.nvfp4(x))
