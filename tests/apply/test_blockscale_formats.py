"""MXFP8 / NVFP4 emulation against hand-computed examples (autoprec.formats).

Every expected value below is worked out by hand from the definitions in the module
docstrings (OCP MX spec v1.0 section 6.3; NVIDIA's two-level NVFP4 recipe), not by
running the code under test.
"""

from __future__ import annotations

import pytest
import torch

from autoprec.formats import (
    BlockShapeError,
    dequantize_mx,
    dequantize_nvfp4,
    fake_quant_block,
    fake_quant_fp8,
    fake_quant_mx,
    fake_quant_mxfp8,
    fake_quant_nvfp4,
    quantize_mx,
    quantize_nvfp4,
)
from autoprec.formats.elements import (
    E5M2,
    e2m1_codes,
    e2m1_values,
    e8m0_to_float,
    pack_e2m1,
    pow2,
    round_e2m1,
    unpack_e2m1,
)
from autoprec.formats.layout import blocked_offset, from_blocked, to_blocked

NAN = float("nan")


def _block(values: list[float], fill: float = 0.0, n: int = 32) -> torch.Tensor:
    """One (1, n) row: ``values`` first, then ``fill``."""
    return torch.tensor([values + [fill] * (n - len(values))], dtype=torch.float32)


def _scale_byte(q) -> list[int]:  # noqa: ANN001
    return q.scale.view(torch.uint8).flatten().tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


# --- element codecs --------------------------------------------------------------------


def test_pow2_is_exact_over_the_e8m0_range() -> None:
    e = torch.arange(-127, 128)
    assert torch.equal(pow2(e).double(), torch.tensor([2.0**i for i in range(-127, 128)],
                                                      dtype=torch.float64))


def test_e8m0_decoding_nan_and_bounds() -> None:
    s = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    v = e8m0_to_float(s)
    assert v[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127]
    assert torch.isnan(v[4])


@pytest.mark.parametrize("x, want", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0),   # ties on the 0.5 grid -> even code
    (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),                   # ties on the 1 and 2 grids
    (0.3, 0.5), (2.2, 2.0), (4.9, 4.0), (5.1, 6.0),       # plain nearest
    (7.0, 6.0), (1e9, 6.0), (float("inf"), 6.0),          # saturation
    (-1.25, -1.0), (-5.0, -4.0), (-7.0, -6.0),
])
def test_e2m1_round_to_nearest_even_and_saturate(x: float, want: float) -> None:
    assert round_e2m1(torch.tensor([x])).item() == want


def test_e2m1_codes_values_and_packing_round_trip() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = torch.cat([grid, -grid])
    codes = e2m1_codes(vals)
    assert codes[:8].tolist() == list(range(8)) and codes[9:].tolist() == list(range(9, 16))
    assert torch.equal(e2m1_values(codes), vals)
    packed = pack_e2m1(codes)  # (8,) fp4x2: element 2i low nibble, 2i+1 high nibble
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert packed.view(torch.uint8)[0].item() == 0x10 and packed.view(torch.uint8)[1].item() == 0x32
    assert torch.equal(unpack_e2m1(packed), codes)


# --- MXFP8 -----------------------------------------------------------------------------


def test_mx_exact_representable_block_round_trips_exactly() -> None:
    # e4m3 grid values whose max (448) lies in [256, 512): shared exponent e with X = 2**e.
    p = [448.0, -256.0, 1.0, -0.5, 2.0**-9, 3.5, 0.0, 104.0, -2.0**-6]  # 2**-9: min subnormal
    for e in (-3, 0, 5):
        x = _block([v * 2.0**e for v in p])
        q = quantize_mx(x)
        assert _scale_byte(q) == [127 + e]
        assert torch.equal(dequantize_mx(q), x)


@pytest.mark.parametrize("amax, byte, top", [
    (1.0, 119, 1.0),        # floor(log2 1) - 8 = -8
    (448.0, 127, 448.0),    # 8 - 8 = 0
    # floor(log2 0.3) = -2 -> X = 2**-10; 0.3 / X = 307.2 lies between the e4m3 values 288
    # and 320 (step 32 in [256, 512)) -> 320, so the max dequantises to 320 * 2**-10.
    (0.3, 117, 0.3125),
    (1e4, 132, 10240.0),    # floor(log2 1e4) = 13 -> X = 2**5; 312.5 -> 320; 320 * 32
])
def test_mx_block_max_sets_the_scale(amax: float, byte: int, top: float) -> None:
    q = quantize_mx(_block([amax, amax / 100]))
    assert _scale_byte(q) == [byte]
    assert dequantize_mx(q)[0, 0].item() == top


def test_mx_block_max_saturates_at_448_under_the_spec_floor_scale() -> None:
    # amax 500: floor(log2 500) = 8 -> X = 1; 500 > 448 saturates (spec: clamp to max normal).
    q = quantize_mx(_block([500.0, 460.0, -1000.0 / 2.2]))
    assert _scale_byte(q) == [127]
    assert dequantize_mx(q)[0, :3].tolist() == [448.0, 448.0, -448.0]
    # rceil (NVIDIA): X = 2**ceil(log2(500 / 448)) = 2; 250 -> 256 (step 16), 230 -> 224 or 240:
    # 230 is 6 above 224 and 10 below 240 -> 224.
    r = quantize_mx(_block([500.0, 460.0]), scale_mode="rceil")
    assert _scale_byte(r) == [128]
    assert dequantize_mx(r)[0, :2].tolist() == [512.0, 448.0]


def test_mx_all_zero_block_gets_the_smallest_scale_and_stays_zero() -> None:
    x = torch.cat([_block([]), _block([3.0, -1.0])], dim=1)  # (1, 64): a zero block, then one
    q = quantize_mx(x)
    assert _scale_byte(q) == [0, 120]  # 2**-127; floor(log2 3) - 8 = -7
    out = dequantize_mx(q)
    assert torch.equal(out[0, :32], torch.zeros(32)) and out[0, 32:34].tolist() == [3.0, -1.0]


def test_mx_e4m3_subnormal_elements_and_rne_ties() -> None:
    # X = 1 (amax 448): elements below 2**-6 are e4m3 subnormals, step 2**-9.
    s = 2.0**-9
    x = _block([448.0, 4 * s, 0.001, 1.25 * s, 2.5 * s, 3.5 * s, 0.5 * s, 17.0, 19.0, 100.0,
                1.0625, 1.1875])
    got = dequantize_mx(quantize_mx(x))[0, :12].tolist()
    assert got == [448.0, 4 * s,
                   s,          # 0.001 = 0.512 * 2**-9 -> 1 * 2**-9
                   s,          # 1.25 -> 1
                   2 * s,      # tie 2.5 -> 2 (even)
                   4 * s,      # tie 3.5 -> 4 (even)
                   0.0,        # tie 0.5 -> 0 (even)
                   16.0, 20.0,  # ties at step 2: 17 -> 16 (m=000), 19 -> 20 (m=010)
                   96.0,       # tie at step 8: 100 -> 96 (m=100) not 104 (m=101)
                   1.0, 1.25]  # ties at step 1/8


def test_mx_tiny_block_is_clamped_at_e8m0_lower_bound() -> None:
    # amax 2**-120: floor - 8 = -128 < -127 -> X = 2**-127 (E8M0's smallest scale).
    x = _block([2.0**-120, 2.0**-130, 2.0**-135, 2.0**-137, 1.5 * 2.0**-137, 2.0**-140])
    q = quantize_mx(x)
    assert _scale_byte(q) == [0]
    got = dequantize_mx(q)[0, :6].tolist()
    # / 2**-127: 128, 2**-3 (normal), 2**-8 (subnormal 2 * 2**-9), 2**-10 (tie -> 0),
    # 0.75 * 2**-9 (-> 2**-9), 2**-13 (-> 0)
    assert got == [2.0**-120, 2.0**-130, 2.0**-135, 0.0, 2.0**-136, 0.0]


def test_mx_fp32_subnormal_block() -> None:
    x = _block([2.0**-140, -(2.0**-145)])  # fp32 subnormals: X = 2**-127, elements 2**-13 -> 0
    q = quantize_mx(x)
    assert _scale_byte(q) == [0]
    assert torch.equal(dequantize_mx(q), torch.zeros(1, 32))


@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
def test_mx_nan_or_inf_makes_its_block_nan_only(bad: float) -> None:
    x = torch.cat([_block([1.0, bad]), _block([2.0, -3.0])], dim=1)
    q = quantize_mx(x)
    assert _scale_byte(q) == [255, 120]  # 0xFF = NaN scale
    out = dequantize_mx(q)
    assert torch.isnan(out[0, :32]).all()
    assert out[0, 32:34].tolist() == [2.0, -3.0]


def test_mx_per_block_scaling_keeps_small_values_that_per_tensor_fp8_flushes() -> None:
    torch.manual_seed(0)
    small = 1e-3 * (1.0 + torch.rand(1, 32))  # (1, 32) values ~1e-3
    x = torch.cat([_block([1e4]), small], dim=1)  # block 0: one outlier; block 1: small
    # per-tensor fp8: scale 448 / 1e4 puts 1e-3 at 4.5e-5 < 2**-10 (half e4m3's min
    # subnormal): the small block flushes to zero.
    fp8 = fake_quant_fp8(x)
    assert torch.equal(fp8[:, 32:], torch.zeros(1, 32))
    mx = fake_quant_mxfp8(x)
    # its own scale: e4m3's 3 mantissa bits (measured 6.1%: this block's max sits just
    # under 2**-9, so the spec's floor scale pushes its top values past 448, where they
    # saturate; NVIDIA's rceil scale avoids that: 2.8%)
    assert _rel(mx[:, 32:], small) < 0.08
    assert _rel(fake_quant_mxfp8(x, scale_mode="rceil")[:, 32:], small) < 0.04
    assert mx[0, 0].item() == 10240.0  # the outlier itself: see test_mx_block_max_sets_the_scale


def test_mx_k_not_divisible_raises_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"multiple of the block size 32.*K=48"):
        quantize_mx(torch.randn(2, 48))
    with pytest.raises(BlockShapeError):
        fake_quant_mxfp8(torch.randn(2, 40))


def test_mx_leading_dims_bf16_input_and_e5m2_elements() -> None:
    x = torch.randn(2, 3, 64)
    q = quantize_mx(x)
    assert q.data.shape == (2, 3, 64) and q.scale.shape == (2, 3, 2)
    assert torch.equal(fake_quant_mxfp8(x.bfloat16()), fake_quant_mxfp8(x.bfloat16().float()))
    # E5M2: emax 15, so amax 1 gives X = 2**-15 (byte 112); 1.2 -> 1.25 at 2 mantissa bits
    r = quantize_mx(_block([1.0, 1.2]), elem=E5M2)
    assert _scale_byte(r) == [112]
    assert dequantize_mx(r)[0, :2].tolist() == [1.0, 1.25]
    assert torch.equal(fake_quant_mx(x, elem=E5M2), dequantize_mx(quantize_mx(x, elem=E5M2)))


# --- NVFP4 -----------------------------------------------------------------------------


def _nv_row(blocks: list[list[float]]) -> torch.Tensor:
    return torch.cat([_block(b, n=16) for b in blocks], dim=1)


def test_nvfp4_exact_values_round_trip_with_unit_tensor_scale() -> None:
    # amax 2688 = 448 * 6 makes g = 1; each block's max/6 is an E4M3 value, so s_b is exact.
    g = [6.0, -4.0, 3.0, 0.5, 0.0, 1.5, -2.0, 1.0]
    x = _nv_row([[v * 448 for v in g], [v * 1.0 for v in g], [v * 2.0**-6 for v in g],
                 [v * 0.875 for v in g]])
    q = quantize_nvfp4(x)
    assert q.tensor_scale.item() == 1.0
    assert q.block_scale.float().flatten().tolist() == [448.0, 1.0, 2.0**-6, 0.875]
    assert q.block_scale.view(torch.uint8).flatten().tolist() == [0x7E, 0x38, 0x08, 0x36]
    assert torch.equal(dequantize_nvfp4(q), x)


def test_nvfp4_tensor_scale_is_amax_over_2688() -> None:
    x = _nv_row([[10.0, -3.0]])
    q = quantize_nvfp4(x)
    assert q.tensor_scale.item() == (torch.tensor(10.0) / 2688).item()  # fp32 division
    # the block holding the tensor max gets s_b = (10 / 6) / g, which rounds to E4M3's 448
    assert q.block_scale.float().item() == 448.0
    assert dequantize_nvfp4(q)[0, 0].item() == pytest.approx(10.0, rel=1e-6)


def test_nvfp4_block_scale_rounding_saturates_the_block_max() -> None:
    # g = 1 (tensor amax 2688). Block amax 6.375: s = 1.0625, an E4M3 tie between 1 and
    # 1.125 -> 1 (even); then 6.375 / 1 saturates to 6: the NVFP4 near-max error.
    x = _nv_row([[2688.0], [6.375, 1.0]])
    q = quantize_nvfp4(x)
    assert q.block_scale.float().flatten().tolist() == [448.0, 1.0]
    assert dequantize_nvfp4(q)[0, 16:18].tolist() == [6.0, 1.0]


def test_nvfp4_zero_block_zero_tensor_and_the_scale_floor() -> None:
    x = _nv_row([[2688.0], [], [6 * 2.0**-8, 2.0**-8]])
    q = quantize_nvfp4(x)
    # zero block: s_b clamped to E4M3's smallest normal 2**-6; codes 0
    # tiny block: ideal s_b = 2**-8 < 2**-6 -> 2**-6; 6 * 2**-8 * 64 = 1.5 (exact),
    # 2**-8 * 64 = 0.25 -> tie -> 0
    assert q.block_scale.float().flatten().tolist() == [448.0, 2.0**-6, 2.0**-6]
    out = dequantize_nvfp4(q)
    assert torch.equal(out[0, 16:32], torch.zeros(16))
    assert out[0, 32:34].tolist() == [6 * 2.0**-8, 0.0]
    z = quantize_nvfp4(torch.zeros(2, 32))  # all-zero tensor: g = 1, zeros (not NaN)
    assert z.tensor_scale.item() == 1.0
    assert torch.equal(dequantize_nvfp4(z), torch.zeros(2, 32))


@pytest.mark.parametrize("bad", [NAN, float("inf")])
def test_nvfp4_non_finite_tensor_is_all_nan(bad: float) -> None:
    x = _nv_row([[1.0, bad], [2.0]])
    assert torch.isnan(fake_quant_nvfp4(x)).all()


def test_nvfp4_per_block_scaling_keeps_small_blocks_down_to_its_scale_floor() -> None:
    torch.manual_seed(0)
    small = 1.0 + torch.rand(1, 16)  # (1, 16) values in [1, 2)
    x = torch.cat([_block([1e4], n=16), small], dim=1)
    # per-tensor e2m1 (scale 6 / 1e4) would put the small block at ~1e-3 < 0.25: all zero
    per_tensor = round_e2m1(x * (6 / 1e4)) * (1e4 / 6)
    assert torch.equal(per_tensor[:, 16:], torch.zeros(1, 16))
    # NVFP4: g = 1e4 / 2688, the block's own E4M3 scale (2 / 6) / g = 0.09 > 2**-6 holds it
    # at e2m1 resolution (1 mantissa bit: measured 11.6%)
    assert _rel(fake_quant_nvfp4(x)[:, 16:], small) < 0.15
    # ...but a block more than 448 * 64 = 28672x below the tensor max would need an E4M3
    # scale under 2**-6: it is clamped there (coarser), and values under amax / 688128
    # (0.25 * g * 2**-6 relative to amax / 2688) flush to zero — here ~1e-9 of the max
    tiny = torch.cat([_block([1e4], n=16), small * 1e-5], dim=1)
    assert torch.equal(fake_quant_nvfp4(tiny)[:, 16:], torch.zeros(1, 16))


def test_nvfp4_k_not_divisible_and_dispatch() -> None:
    with pytest.raises(ValueError, match=r"nvfp4.*block size 16.*K=24"):
        quantize_nvfp4(torch.randn(3, 24))
    x = torch.randn(4, 64)
    assert torch.equal(fake_quant_block(x, "nvfp4"), fake_quant_nvfp4(x))
    assert torch.equal(fake_quant_block(x, "mxfp8"), fake_quant_mxfp8(x))
    with pytest.raises(ValueError, match="unknown block-scaled format"):
        fake_quant_block(x, "mxfp4")


# --- the cuBLAS scale layout ---------------------------------------------------------------


@pytest.mark.parametrize("rows, cols", [(128, 4), (130, 7), (5, 3), (256, 64)])
def test_swizzle_matches_the_cublas_offset_formula(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    s = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8)
    s = s.view(torch.float8_e8m0fnu)
    flat = to_blocked(s)
    assert flat.dtype == s.dtype
    assert flat.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    fb, sb = flat.view(torch.uint8), s.view(torch.uint8)
    for r in range(0, rows, max(1, rows // 17)):
        for c in range(cols):
            assert fb[blocked_offset(r, c, cols)] == sb[r, c]
    assert torch.equal(from_blocked(flat, rows, cols).view(torch.uint8), sb)
