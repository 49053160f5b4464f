"""The NVFP4 training recipe's quantisers: E2M1 grid, 16x16 weight tiles, stochastic
rounding, the random Hadamard transform (autoprec.formats.nvfp4_train)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from autoprec.formats.elements import E2M1_VALUES, BlockShapeError, cast_fp8, round_e2m1
from autoprec.formats.nvfp4 import dequantize_nvfp4, nvfp4_tensor_scale, quantize_nvfp4
from autoprec.formats.nvfp4_train import (
    fake_quant_nvfp4_1d,
    hadamard16,
    quantize_nvfp4_1d,
    quantize_nvfp4_2d,
    rht,
    rht_matrix,
    rht_signs,
    round_e2m1_stochastic,
    transpose_2d,
)
from tests import reference_formats

GRID = sorted({s * v for v in E2M1_VALUES for s in (1.0, -1.0)})


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_stochastic_rounding_lands_on_the_e2m1_grid_and_keeps_grid_values() -> None:
    x = torch.linspace(-8, 8, 4001)
    r = round_e2m1_stochastic(x, _gen())
    assert set(r.unique().tolist()) <= set(GRID)
    assert r.abs().max() == 6.0  # saturates at ±6
    # each value goes to one of its two grid neighbours, never further
    lo = torch.tensor([max(g for g in GRID if g <= v) for v in x.clamp(-6, 6).tolist()])
    hi = torch.tensor([min(g for g in GRID if g >= v) for v in x.clamp(-6, 6).tolist()])
    assert bool(((r == lo) | (r == hi)).all())
    on_grid = torch.tensor(GRID)
    assert torch.equal(round_e2m1_stochastic(on_grid, _gen()), on_grid)


def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not() -> None:
    """A block whose amax is 6 has decode scale 1 (g = 6 / 2688, s_b = 448): the elements
    are the E2M1 values themselves. Over 20,000 independent draws the mean of the
    stochastic rounding is the value (std of one draw <= half the spacing, 1 at most:
    the standard error is < 0.01); round-to-nearest keeps its bias (0.2 -> 0)."""
    row = torch.tensor([6.0, 0.2, 0.7, 1.2, 1.8, 2.5, 3.3, 4.9, 5.5, -0.2, -0.7, -1.3, -2.6,
                        -3.9, -4.4, 0.05])
    x = row.repeat(20_000, 1)  # (20000, 16): one block per row
    sr = fake_quant_nvfp4_1d(x, stochastic=True, generator=_gen())
    assert float((sr.mean(0) - row).abs().max()) < 0.03
    rn = fake_quant_nvfp4_1d(x)
    assert torch.equal(rn, round_e2m1(x))  # deterministic, the nearest grid value
    assert float((rn.mean(0) - row).abs().max()) > 0.19  # 0.2 -> 0, 5.5 -> 6, ...
    # the same generator seed draws the same rounding; another seed another
    again = fake_quant_nvfp4_1d(x[:64], stochastic=True, generator=_gen())
    assert torch.equal(again, sr[:64])
    assert not torch.equal(fake_quant_nvfp4_1d(x[:64], stochastic=True, generator=_gen(1)),
                           sr[:64])


def test_1d_round_to_nearest_is_the_forward_quantiser_bit_for_bit() -> None:
    x = torch.randn(8, 64, generator=_gen()) * torch.logspace(-3, 3, 64)
    a, b = quantize_nvfp4_1d(x), quantize_nvfp4(x)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.tensor_scale, b.tensor_scale)
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))


def test_2d_weight_tiles_one_scale_per_16x16_and_w_transposed_quantises_identically() -> None:
    w = torch.randn(48, 64, generator=_gen()) * torch.logspace(-2, 2, 64)  # K-varying range
    q = quantize_nvfp4_2d(w)
    assert q.block_scale.shape == (48, 4)
    # one scale per tile, by hand: E4M3((tile amax / 6) / g)
    g = nvfp4_tensor_scale(w)
    tile = w[16:32, 32:48]
    want = cast_fp8((tile.abs().amax() / 6.0) / g)
    assert bool((q.block_scale[16:32, 2].float() == want.float()).all())
    # every element on the grid times its tile's decode scale
    v = dequantize_nvfp4(q)
    units = v[16:32, 32:48] / (g * want.float())
    assert torch.allclose(units, round_e2m1(units), rtol=1e-6, atol=0)
    assert torch.equal(v, reference_formats.nvfp4_2d(w))  # the independent hand reference
    # W^T quantised afresh == the tiles of W transposed, values and encodings
    qt = quantize_nvfp4_2d(w.t().contiguous())
    assert torch.equal(dequantize_nvfp4(qt), v.t())
    tq = transpose_2d(q)
    assert torch.equal(tq.codes, qt.codes)
    assert torch.equal(tq.block_scale.view(torch.uint8), qt.block_scale.view(torch.uint8))
    # 1x16 blocks do not have that symmetry (the reason for the 2-D tiles)
    assert not torch.equal(dequantize_nvfp4(quantize_nvfp4(w.t().contiguous())),
                           dequantize_nvfp4(quantize_nvfp4(w)).t())
    with pytest.raises(BlockShapeError, match=r"both dims .* multiples of 16.*\(40, 64\)"):
        quantize_nvfp4_2d(torch.randn(40, 64))


def test_the_hadamard_transform_is_orthogonal_and_leaves_the_wgrad_product_unchanged() -> None:
    h = hadamard16()
    assert set(h.flatten().tolist()) == {0.25, -0.25}
    assert torch.equal(h @ h, torch.eye(16))  # symmetric and orthogonal, exactly
    s = rht_signs()
    assert set(s.tolist()) == {1.0, -1.0} and torch.equal(s, rht_signs())  # fixed seed
    r = rht_matrix(s)
    assert torch.allclose(r @ r.t(), torch.eye(16), atol=1e-6)
    a, b = torch.randn(37, 24, generator=_gen()), torch.randn(37, 40, generator=_gen(1))
    ta, tb = rht(a, r), rht(b, r)  # 37 tokens padded to 48
    assert ta.shape == (48, 24)
    assert torch.allclose(ta.t() @ tb, a.t() @ b, atol=1e-4)


def _wgrad(dy: torch.Tensor, x: torch.Tensor, seed: int, on: str = "both") -> torch.Tensor:
    """dY^T X from 1x16 blocks along the tokens, dY stochastic, after the transform on
    ``on`` ("both", "none", or "dy": a broken recipe)."""
    r = rht_matrix(rht_signs())
    if on in ("both", "dy"):
        dy = rht(dy, r)
    if on == "both":
        x = rht(x, r)
    return fake_quant_nvfp4_1d(dy.t().contiguous(), stochastic=True, generator=_gen(seed)) @ \
        fake_quant_nvfp4_1d(x.t().contiguous()).t()


def test_wgrad_with_the_transform_on_both_operands_is_the_product() -> None:
    """The transform changes what is rounded, not the product: dW from transformed operands
    is as close to the exact dY^T X as without it (16x16 orthogonal blocks; no gain on iid
    data of this size, measured: 0.17 vs 0.17), its stochastic error averages out over
    draws, and a transform on one operand alone is no product at all."""
    g = _gen(3)
    x, dy = torch.randn(512, 64, generator=g), torch.randn(512, 32, generator=g)
    exact = dy.t() @ x

    def err(t: torch.Tensor) -> float:
        return float((t - exact).norm() / exact.norm())

    one = err(_wgrad(dy, x, 0))
    assert one < 0.25 and abs(one - err(_wgrad(dy, x, 0, on="none"))) < 0.05
    mean = torch.stack([_wgrad(dy, x, s) for s in range(16)]).mean(0)
    assert err(mean) < 0.75 * one  # the stochastic part of the error averages out
    assert err(_wgrad(dy, x, 0, on="dy")) > 0.9


def test_the_hadamard_matrix_is_torchaos() -> None:
    """torchao's NVFP4 training builds its RHT matrix as diag(signs) @ H16 / 4 too."""
    name = "torchao.prototype.moe_training.nvfp4_training.hadamard_utils"
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        pytest.skip(f"{name} does not import here")
    mod = pytest.importorskip(name)
    s = rht_signs()
    theirs = mod.get_rht_matrix(tuple(int(v) for v in s.tolist()), "cpu", torch.float32, 16)
    assert torch.equal(rht_matrix(s), theirs)
