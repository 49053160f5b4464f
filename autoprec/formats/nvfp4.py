"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements along K, and a per-tensor fp32 scale.

Recipe (NVIDIA's two-level scaling as Transformer Engine documents it — "s_global =
448 * 6 / amax, s_block = (block_amax / 6) * s_global stored in E4M3" — written in
decode-scale form exactly as torchao's ``nvfp4_quantize`` with ``per_tensor_scale`` does,
so the two agree bit for bit):

    g     = amax(|x|) / (448 * 6)                     # per-tensor decode scale, fp32
    s_b   = RNE_e4m3(clamp((amax_b / 6) / g, 2**-6, 448))   # per-block decode scale
    q_i   = RNE_e2m1(clamp(x_i * ((1 / g) / s_b), -6, 6))
    value = q_i * (g * s_b)

- The per-tensor scale puts the largest block scale at E4M3's max (448), so block scales
  use E4M3's whole normal range; blocks whose ideal scale is below E4M3's smallest normal
  (2**-6, i.e. amax_b < amax / 28672) are clamped up to it (torchao's ``E4M3_EPS``; this
  keeps an all-zero block's scale non-zero and avoids E4M3 subnormal scales, which would
  round down and saturate the block's elements).
- Activations use the current tensor's amax (dynamic per-tensor scale); weights use their
  own amax. ``tensor_scale`` may be passed in (a calibrated or shared amax).
- An all-zero tensor, or one so small that g is not a normal fp32 (amax < 2688 * 2**-126,
  about 3.2e-35, where 1 / g would overflow), takes g = 1: its values are zero (torchao
  divides by g = 0 and returns NaN for an all-zero tensor).
- A tensor with any NaN or ±inf has no finite per-tensor scale: g = NaN and the whole
  tensor dequantises to NaN (E2M1 has no NaN or inf encoding).
- The E4M3 scale's rounding can leave amax_b / (g * s_b) slightly above 6: such elements
  saturate to 6 (NVFP4's near-max error; the "Four Over Six" paper, arXiv 2512.02010).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoprec.formats.elements import (
    E4M3,
    ELEM_MAX,
    cast_fp8,
    e2m1_codes,
    e2m1_values,
    round_e2m1,
    to_blocks,
)

NVFP4_BLOCK = 16
E2M1_MAX = ELEM_MAX["e2m1"]  # 6
E4M3_MAX = ELEM_MAX[E4M3]  # 448
E4M3_MIN_NORMAL = 2.0**-6
_F32_MIN_NORMAL = 2.0**-126


@dataclass(frozen=True)
class NVFP4Tensor:
    """``codes`` (..., K) uint8 E2M1 codes (bit 3 = sign), ``block_scale`` (..., K // 16)
    E4M3, ``tensor_scale`` a 0-d fp32 decode scale."""

    codes: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    block: int = NVFP4_BLOCK

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor decode scale amax(|x|) / (448 * 6) as a 0-d fp32 tensor (rules above)."""
    lo, hi = torch.aminmax(x.detach())  # no fp32 copy of a 16-bit x; NaN propagates
    amax = torch.maximum(-lo.float(), hi.float())
    g = amax / (E4M3_MAX * E2M1_MAX)
    g = torch.where(g >= _F32_MIN_NORMAL, g, torch.ones_like(g))
    return torch.where(torch.isfinite(amax), g, torch.full_like(g, float("nan")))


def _block_scales(x: torch.Tensor, tensor_scale: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as (..., nb, 16) fp32 blocks, the tensor scale, the E4M3 block scales, the
    encode scale per block)."""
    xb = to_blocks(x, NVFP4_BLOCK, "nvfp4")  # (..., nb, 16)
    g = nvfp4_tensor_scale(x) if tensor_scale is None else tensor_scale.float().reshape(())
    amax_b = xb.abs().amax(dim=-1)  # (..., nb)
    s_b = cast_fp8(((amax_b / E2M1_MAX) / g).clamp(min=E4M3_MIN_NORMAL), E4M3)
    recip = (1.0 / g) / s_b.float()  # (..., nb), the encode scale
    return xb, g, s_b, recip


def quantize_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """NVFP4-quantise ``x`` along its last dim (K) in blocks of 16.

    Raises :class:`~autoprec.formats.elements.BlockShapeError` (a ValueError) when K is
    not a multiple of 16.
    """
    xb, g, s_b, recip = _block_scales(x, tensor_scale)
    q = round_e2m1(xb * recip.unsqueeze(-1))  # saturates at ±6
    return NVFP4Tensor(codes=e2m1_codes(q).reshape(x.shape), block_scale=s_b,
                       tensor_scale=g)


def dequantize_nvfp4(q: NVFP4Tensor) -> torch.Tensor:
    """fp32 values ``q_i * (g * s_b)`` of an :class:`NVFP4Tensor`."""
    k = q.codes.shape[-1]
    v = e2m1_values(q.codes).reshape(*q.codes.shape[:-1], k // q.block, q.block)
    scale = q.tensor_scale * q.block_scale.float()  # (..., nb), as torchao's get_hp_scales
    return (v * scale.unsqueeze(-1)).reshape(q.codes.shape)


def fake_quant_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` rounded through NVFP4 along its last dim, in fp32: ``dequantize_nvfp4(
    quantize_nvfp4(x))``'s values, without the 4-bit codes in between (the grid values are
    the codes' values exactly; a NaN block is NaN through its scale either way)."""
    xb, g, s_b, recip = _block_scales(x, tensor_scale)
    q = round_e2m1(xb * recip.unsqueeze(-1))
    return (q * (g * s_b.float()).unsqueeze(-1)).reshape(x.shape)


__all__ = ["NVFP4_BLOCK", "NVFP4Tensor", "dequantize_nvfp4", "fake_quant_nvfp4",
           "nvfp4_tensor_scale", "quantize_nvfp4"]
