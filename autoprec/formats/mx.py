"""MXFP8: OCP Microscaling Formats spec v1.0 — 32-element blocks, one E8M0 scale each.

Quantising a block V_1..V_32 (consecutive elements along the last dim, the GEMM's
reduction dim K), spec section 6.3:

    X   = 2**(floor(log2(max_i |V_i|)) - emax_elem)       # emax_elem = 8 for E4M3, 15 for E5M2
    P_i = RNE_elem(clamp(V_i / X, -max_elem, max_elem))     # max_elem 448 (E4M3), 57344 (E5M2)
    value_i = X * P_i

- The exponent is exact: ``torch.frexp`` gives floor(log2 |a|) for every finite fp32,
  fp32 subnormals included; V_i / X is a power-of-two multiply (exact in fp32).
- Clamping: the exponent is clamped to E8M0's range -127..127 (spec section 5.4). Finite
  fp32 inputs never reach the upper bound (max fp32 < 2**128 gives 127 - 8 = 119); tiny
  blocks (max < 2**-118 for E4M3) are pinned at 2**-127 and their elements fall into
  E4M3's subnormals or to zero.
- An all-zero block gets the smallest scale 2**-127 and zero elements (the spec leaves the
  scale of a zero block free; Microsoft's microxcaling reference and torchao do the same).
- A block containing NaN or ±inf gets the NaN scale (E8M0 0xFF) and dequantises to NaN
  everywhere: floor(log2(inf)) overflows the scale range, and the spec makes every element
  of a block with a NaN scale NaN. (microxcaling, the spec authors' reference: "overflowing
  shared exps" -> NaN. torchao's FLOOR mode instead gives an inf block the scale 2**120;
  tests/apply/test_blockscale_torchao.py lists every difference from torchao.)
- Because X uses the floor, the block max lands in [256, 512) before rounding: values in
  (448, 512) saturate to 448 (up to 12.5% error on the block's largest element). That is
  the spec's rule. ``scale_mode="rceil"`` is NVIDIA's alternative (cuBLAS / Transformer
  Engine MXFP8 quantisation, cuBLAS docs "block quantization"): X = 2**ceil(log2(max /
  max_elem)), which never saturates. On real MiniLM it keeps MXFP8 at per-tensor fp8's error
  where the floor scale costs up to 14x more (benchmarks/results/blockscale_error.md).

Dequantisation: fp32 ``P_i * X`` (exact: at most 4 significant bits times a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoprec.formats.elements import (
    E4M3,
    E5M2,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    ELEM_EMAX,
    ELEM_MAX,
    cast_fp8,
    e8m0_from_exponent,
    e8m0_to_float,
    pow2,
    to_blocks,
)

MX_BLOCK = 32
SCALE_MODES = ("floor", "rceil")

#: How autoprec's MXFP8 GEMMs choose scales: NVIDIA's "rceil" (X = 2^ceil(log2(amax / 448)):
#: the block max never saturates), what cuBLAS and Transformer Engine compute on Blackwell,
#: so the emulation matches the kernels a B200 runs. The OCP spec's "floor" rule (this
#: module's default) saturates a block's largest values by up to 12.5 %:
#: benchmarks/results/blockscale_error.md measured it 1.1-2x fp8's error on outlier layers.
MX_SCALE_MODE = "rceil"


@dataclass(frozen=True)
class MXTensor:
    """An MX-quantised tensor: ``data`` (..., K) fp8 elements, ``scale`` (..., K // block) E8M0."""

    data: torch.Tensor
    scale: torch.Tensor
    block: int = MX_BLOCK

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for finite a > 0 (int32), exact: a = m * 2**ex with m in [0.5, 1)."""
    _, ex = torch.frexp(a)
    return ex - 1


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) for finite a > 0 (int32), exact."""
    m, ex = torch.frexp(a)
    return torch.where(m == 0.5, ex - 1, ex)


def mx_scale_exponent(amax: torch.Tensor, elem: torch.dtype = E4M3,
                      scale_mode: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """The shared exponent of each block from its amax: ``(e int32, nan bool)``.

    ``floor`` (OCP spec): e = floor(log2(amax)) - emax_elem. ``rceil`` (NVIDIA):
    e = ceil(log2(amax / max_elem)). Both clamped to -127..127; zero blocks get -127;
    blocks whose amax is NaN or inf are flagged ``nan``.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"MX scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    amax = amax.float()
    nan = ~torch.isfinite(amax)
    pos = (amax > 0) & ~nan
    safe = torch.where(pos, amax, torch.ones_like(amax))
    if scale_mode == "floor":
        e = _floor_log2(safe) - ELEM_EMAX[elem]
    else:
        e = _ceil_log2(safe / ELEM_MAX[elem])
    e = torch.where(pos, e, torch.full_like(e, E8M0_MIN_EXP))
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP), nan


def quantize_mx(x: torch.Tensor, block: int = MX_BLOCK, elem: torch.dtype = E4M3,
                scale_mode: str = "floor") -> MXTensor:
    """MX-quantise ``x`` along its last dim (K) in blocks of ``block`` elements.

    ``elem`` is ``torch.float8_e4m3fn`` (MXFP8, the default) or ``torch.float8_e5m2``.
    Raises :class:`~autoprec.formats.elements.BlockShapeError` (a ValueError) when K is
    not a multiple of ``block``.
    """
    if elem not in (E4M3, E5M2):
        raise ValueError(f"MX element dtype must be float8_e4m3fn or float8_e5m2, got {elem}")
    xb = to_blocks(x, block, "mxfp8" if elem == E4M3 else "mx e5m2")  # (..., nb, block)
    amax = xb.abs().amax(dim=-1)  # (..., nb); NaN propagates
    e, nan = mx_scale_exponent(amax, elem, scale_mode)
    scaled = xb * pow2(-e).unsqueeze(-1)  # V_i / X, exact
    data = cast_fp8(scaled, elem).reshape(x.shape)
    return MXTensor(data=data, scale=e8m0_from_exponent(e, nan), block=block)


def dequantize_mx(q: MXTensor) -> torch.Tensor:
    """fp32 values of an :class:`MXTensor` (NaN-scale blocks are all NaN)."""
    k = q.data.shape[-1]
    d = q.data.float().reshape(*q.data.shape[:-1], k // q.block, q.block)
    return (d * e8m0_to_float(q.scale).unsqueeze(-1)).reshape(q.data.shape)


def fake_quant_mx(x: torch.Tensor, block: int = MX_BLOCK, elem: torch.dtype = E4M3,
                  scale_mode: str = "floor") -> torch.Tensor:
    """``x`` rounded through MX (quantise then dequantise) along its last dim, in fp32."""
    return dequantize_mx(quantize_mx(x, block, elem, scale_mode))


def fake_quant_mxfp8(x: torch.Tensor, scale_mode: str = "floor") -> torch.Tensor:
    """``x`` rounded through MXFP8 (E4M3 elements, E8M0 scale per 32 along the last dim)."""
    return fake_quant_mx(x, MX_BLOCK, E4M3, scale_mode)


def fake_quant_mxfp8_padded(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 fake-quant along the last dim as the GEMMs run it (``MX_SCALE_MODE``),
    zero-padding it to a multiple of 32 first (zeros leave a block's amax unchanged: a
    partial last block). The MXFP8 gradient recipe reduces over dims of any size."""
    pad = (-t.shape[-1]) % 32
    if not pad:
        return fake_quant_mxfp8(t, MX_SCALE_MODE)
    return fake_quant_mxfp8(torch.nn.functional.pad(t, (0, pad)),
                            MX_SCALE_MODE)[..., : t.shape[-1]]


__all__ = ["MX_BLOCK", "MX_SCALE_MODE", "MXTensor", "dequantize_mx", "fake_quant_mx",
           "fake_quant_mxfp8", "fake_quant_mxfp8_padded", "mx_scale_exponent", "quantize_mx"]
