"""``round_e2m1`` (the FPU's own rounding, by adding a power of two) against the
definition (``tests.reference_formats``: the grid, midpoints, ties to the even code) over a
sweep of the fp32 bit patterns; ``fake_quant_nvfp4`` against the 4-bit codes' round trip."""

from __future__ import annotations

import numpy as np
import torch

from autoprec.formats.elements import round_e2m1
from autoprec.formats.nvfp4 import dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4
from autoprec.formats.nvfp4_train import (
    fake_quant_nvfp4_1d,
    fake_quant_nvfp4_2d,
    quantize_nvfp4_1d,
    quantize_nvfp4_2d,
)
from tests.reference_formats import E2M1, round_to


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bit for bit (-0.0 is not 0.0), any NaN equal to any NaN."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


def test_every_257th_bit_pattern_and_the_grids_midpoints_round_as_defined() -> None:
    bits = np.arange(0, 2**32, 257, dtype=np.uint64).astype(np.uint32)
    sweep = torch.from_numpy(bits.view(np.float32).copy())
    grid = torch.tensor(E2M1.grid)
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, grid, torch.nextafter(mids, torch.tensor(0.0)),
                      torch.nextafter(mids, torch.tensor(9.0)), torch.tensor([6.5, 1e30])])
    x = torch.cat([sweep, near, -near, torch.tensor([float("inf"), -float("inf"), -0.0])])
    before = x.clone()
    got, want = round_e2m1(x), round_to(E2M1, x)
    same = _same(got, want)
    assert bool(same.all()), list(zip(x[~same][:5].tolist(), got[~same][:5].tolist()))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # the input untouched


def test_fake_quant_is_the_codes_round_trip() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-6, 4, 64)[:, None]
    x[3, 16:32] = 0.0  # a zero block
    x[5, 40] = float("nan")  # a NaN block
    x[7, 70] = float("inf")
    x[9, 0:16] = -1e-30  # below the scales' range
    for scale in (None, torch.tensor(0.37)):
        got = fake_quant_nvfp4(x, scale)
        want = dequantize_nvfp4(quantize_nvfp4(x, scale))
        assert bool(_same(got, want).all())


def test_the_training_recipes_fake_quants_are_the_codes_round_trips() -> None:
    """NVFP4 training's 1x16 (RNE and stochastic, the same uniforms drawn) and 16x16 weight
    fake-quants: the values of their quantised tensors, decoded."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-5, 3, 48)[:, None]
    x[2, 16:32] = 0.0
    x[6, 5] = float("nan")
    for stochastic in (False, True):
        got = fake_quant_nvfp4_1d(x, stochastic=stochastic,
                                  generator=torch.Generator().manual_seed(9))
        want = dequantize_nvfp4(quantize_nvfp4_1d(x, stochastic=stochastic,
                                                  generator=torch.Generator().manual_seed(9)))
        assert bool(_same(got, want).all())
    assert bool(_same(fake_quant_nvfp4_2d(x), dequantize_nvfp4(quantize_nvfp4_2d(x))).all())
