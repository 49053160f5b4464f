"""The quantisers of NVIDIA's NVFP4 training recipe, beside the 1x16 codec of ``nvfp4.py``.

NVIDIA's NVFP4 pre-training recipe (arXiv 2509.25149; Transformer Engine's
``NVFP4BlockScaling``, docs/features/low_precision_training/nvfp4; torchao's
``prototype/moe_training/nvfp4_training``) quantises the three GEMMs of a Linear differently:

- activations and gradients: 1x16 blocks along the GEMM's reduction dim, an E4M3 scale
  per block and a per-tensor fp32 scale (``nvfp4.quantize_nvfp4``);
- weights: 16x16 tiles, one E4M3 scale per tile (:func:`quantize_nvfp4_2d`), so that W
  (fprop, reduced along K) and W^T (dgrad, reduced along N) are the same numbers: each
  row of a tile carries the tile's scale, which is a valid 1x16 block scale either way;
- gradients are rounded stochastically (:func:`round_e2m1_stochastic`): unbiased, so small
  gradient contributions survive in expectation; X and W round to nearest (RNE);
- the wgrad operands (dY and X, both reduced along the tokens M) pass through a random
  Hadamard transform first (:func:`rht`): each 16 consecutive tokens are multiplied by
  R = diag(s) H16 (H16 the Sylvester Hadamard matrix / 4, s a fixed random sign vector),
  an orthogonal map, so dY^T X = (R^T dY)^T (R^T X) exactly while block outliers are
  spread over the 16 values before the 4-bit rounding.

Stochastic rounding draws its uniforms from an explicit ``torch.Generator`` (the caller's),
so the model's own random stream (dropout) is not consumed.
"""

from __future__ import annotations

import torch

from autoprec.formats.elements import (
    E4M3,
    BlockShapeError,
    cast_fp8,
    e2m1_codes,
    round_e2m1,
    to_blocks,
)
from autoprec.formats.nvfp4 import (
    E2M1_MAX,
    E4M3_MIN_NORMAL,
    NVFP4_BLOCK,
    NVFP4Tensor,
    nvfp4_tensor_scale,
)

#: Side of the Hadamard matrix of the wgrad transform (TE and torchao: 16, one NVFP4 block).
RHT_SIZE = 16
#: Seed of the fixed random sign vector of the transform (one vector for every layer).
RHT_SEED = 0


def round_e2m1_stochastic(x: torch.Tensor, generator: torch.Generator | None = None
                          ) -> torch.Tensor:
    """fp32 values rounded onto the E2M1 grid stochastically, saturating at ±6, as fp32.

    A value between grid neighbours lo < |x| < hi rounds to hi with probability
    (|x| - lo) / (hi - lo), else to lo: E[round(x)] = x for |x| <= 6 (TE's NVFP4 docs,
    "Stochastic Rounding"). The grid spacing is 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6].
    """
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    lo = torch.floor(a / step) * step  # exact: step is a power of two
    u = torch.rand(a.shape, generator=generator, device=a.device)
    r = lo + step * (u < (a - lo) / step).float()
    return torch.copysign(r.clamp(max=E2M1_MAX), x)


def _encode(xb: torch.Tensor, g: torch.Tensor, s_b: torch.Tensor, stochastic: bool,
            generator: torch.Generator | None) -> torch.Tensor:
    """E2M1 values of blocks ``xb`` (..., nb, 16) under decode scales g * s_b (..., nb)."""
    recip = (1.0 / g) / s_b.float()  # the encode scale, as nvfp4.quantize_nvfp4
    y = xb * recip.unsqueeze(-1)
    return round_e2m1_stochastic(y, generator) if stochastic else round_e2m1(y)


def quantize_nvfp4_1d(x: torch.Tensor, *, stochastic: bool = False,
                      generator: torch.Generator | None = None) -> NVFP4Tensor:
    """NVFP4 along the last dim in 1x16 blocks; ``stochastic``: stochastic rounding of the
    elements (the scales are computed as ``nvfp4.quantize_nvfp4``'s; with
    ``stochastic=False`` the result is ``quantize_nvfp4(x)`` bit for bit)."""
    xb, g, s_b = _scales_1d(x)
    q = _encode(xb, g, s_b, stochastic, generator)
    return NVFP4Tensor(codes=e2m1_codes(q).reshape(x.shape), block_scale=s_b, tensor_scale=g)


def _scales_1d(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as (..., nb, 16) fp32 blocks, the tensor scale, the E4M3 block scales)."""
    xb = to_blocks(x, NVFP4_BLOCK, "nvfp4")  # (..., nb, 16)
    g = nvfp4_tensor_scale(x)
    s_b = cast_fp8(((xb.abs().amax(dim=-1) / E2M1_MAX) / g).clamp(min=E4M3_MIN_NORMAL), E4M3)
    return xb, g, s_b


def _decoded(q: torch.Tensor, g: torch.Tensor, s_b: torch.Tensor, shape: torch.Size
             ) -> torch.Tensor:
    """E2M1 values ``q`` (..., nb, 16) times their decode scales, as ``dequantize_nvfp4``
    computes them (the grid values are its codes' values exactly), in ``shape``."""
    return (q * (g * s_b.float()).unsqueeze(-1)).reshape(shape)


def quantize_nvfp4_2d(w: torch.Tensor) -> NVFP4Tensor:
    """NVFP4 of a 2-D weight (N, K) in 16x16 tiles, round to nearest.

    One E4M3 scale per tile, from the tile's amax and the weight's per-tensor scale; the
    returned ``block_scale`` (N, K // 16) repeats each tile's scale on its 16 rows, the
    1x16 layout a block-scaled GEMM reads. :func:`transpose_2d` gives W^T's tensor with
    the same values. Raises ``BlockShapeError`` unless both dims are multiples of 16.
    """
    if w.dim() != 2 or w.shape[0] % NVFP4_BLOCK or w.shape[1] % NVFP4_BLOCK:
        raise BlockShapeError(f"nvfp4 2-D weight blocks: both dims of the weight must be "
                              f"multiples of {NVFP4_BLOCK}, but got shape {tuple(w.shape)}")
    q, g, s_b = _encode_2d(w)
    return NVFP4Tensor(codes=e2m1_codes(q).reshape(w.shape), block_scale=s_b, tensor_scale=g)


def fake_quant_nvfp4_2d(w: torch.Tensor) -> torch.Tensor:
    """``dequantize_nvfp4(quantize_nvfp4_2d(w))``'s values (fp32), without the 4-bit codes
    in between."""
    q, g, s_b = _encode_2d(w)
    return _decoded(q, g, s_b, w.shape)


def _encode_2d(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 values (N, K/16, 16), the tensor scale, the tiles' scales as (N, K/16))."""
    if w.dim() != 2 or w.shape[0] % NVFP4_BLOCK or w.shape[1] % NVFP4_BLOCK:
        raise BlockShapeError(f"nvfp4 2-D weight blocks: both dims of the weight must be "
                              f"multiples of {NVFP4_BLOCK}, but got shape {tuple(w.shape)}")
    n, k = w.shape
    b = NVFP4_BLOCK
    g = nvfp4_tensor_scale(w)
    tiles = w.float().reshape(n // b, b, k // b, b)  # (N/16, 16, K/16, 16)
    amax_t = tiles.abs().amax(dim=(1, 3))  # (N/16, K/16)
    s_t = cast_fp8(((amax_t / E2M1_MAX) / g).clamp(min=E4M3_MIN_NORMAL), E4M3)
    s_b = s_t.repeat_interleave(b, dim=0)  # (N, K/16): each row of a tile, its tile's scale
    return _encode(w.float().reshape(n, k // b, b), g, s_b, False, None), g, s_b


def transpose_2d(q: NVFP4Tensor) -> NVFP4Tensor:
    """W^T of a 16x16-tiled :func:`quantize_nvfp4_2d` tensor: the codes transposed, each
    tile's scale repeated on the rows of W^T (no re-rounding: the same values)."""
    b = q.block
    s_t = q.block_scale[::b]  # (N/16, K/16), one row per tile row
    return NVFP4Tensor(codes=q.codes.t().contiguous(),
                       block_scale=s_t.t().repeat_interleave(b, dim=0).contiguous(),
                       tensor_scale=q.tensor_scale)


def hadamard16(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix scaled by 1/4: symmetric, H @ H = I."""
    h = torch.ones(1, 1)
    for _ in range(4):  # 2**4 = 16
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / 4.0).to(device)


def rht_signs(seed: int = RHT_SEED, device: torch.device | str | None = None) -> torch.Tensor:
    """The fixed random sign vector (16,) of ±1.0 drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (RHT_SIZE,), generator=gen) * 2 - 1).float().to(device)


def rht_matrix(signs: torch.Tensor) -> torch.Tensor:
    """R = diag(signs) @ H16 (as torchao's ``get_rht_matrix``): orthogonal, R R^T = I."""
    return torch.diag(signs.float()) @ hadamard16(signs.device)


def rht(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``t`` (M, C) transformed along M in blocks of 16 rows: each block b -> R^T b.

    M is zero-padded to a multiple of 16 first. Both wgrad operands are padded alike and R
    is orthogonal, so (R^T A)^T (R^T B) = A^T B for the padded A, B, whose zero rows add
    nothing to the product. Returns (M', C), M' the padded length.
    """
    m, c = t.shape
    pad = (-m) % RHT_SIZE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, c)])
    blocks = t.float().reshape(-1, RHT_SIZE, c)  # (M'/16, 16, C)
    return torch.matmul(r.t(), blocks).reshape(-1, c)


def fake_quant_nvfp4_1d(x: torch.Tensor, *, stochastic: bool = False,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` rounded through NVFP4 1x16 blocks along its last dim (RNE or stochastic), fp32:
    ``dequantize_nvfp4(quantize_nvfp4_1d(x, ...))``'s values, without the codes."""
    xb, g, s_b = _scales_1d(x)
    return _decoded(_encode(xb, g, s_b, stochastic, generator), g, s_b, x.shape)


def fake_quant_nvfp4_padded(x: torch.Tensor, *, stochastic: bool = False,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`fake_quant_nvfp4_1d` of any last dim: zero-padded to a multiple of 16 (zeros
    change no block's amax nor the tensor's), the padding cut off again."""
    k = x.shape[-1]
    pad = (-k) % NVFP4_BLOCK
    if pad:
        x = torch.cat([x.float(), x.new_zeros(*x.shape[:-1], pad, dtype=torch.float32)], -1)
    return fake_quant_nvfp4_1d(x, stochastic=stochastic, generator=generator)[..., :k]


__all__ = ["RHT_SEED", "RHT_SIZE", "fake_quant_nvfp4_1d", "fake_quant_nvfp4_2d",
           "fake_quant_nvfp4_padded", "hadamard16", "quantize_nvfp4_1d",
           "quantize_nvfp4_2d", "rht", "rht_matrix", "rht_signs", "round_e2m1_stochastic",
           "transpose_2d"]
