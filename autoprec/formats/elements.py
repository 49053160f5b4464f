"""Element and scale codecs shared by the block-scaled formats (MXFP8, NVFP4).

Every rounding here is round-to-nearest, ties-to-even (RNE), with saturation: a finite
value beyond the format's largest magnitude becomes that magnitude (OCP MX spec v1.0,
section 6.3: "normal numbers that exceed the representable range of the element format
are clamped to the maximum representable value"; OCP 8-bit FP spec for E4M3/E5M2).

- E4M3 (``torch.float8_e4m3fn``): max 448, smallest normal 2**-6, subnormals down to
  2**-9. E5M2 (``torch.float8_e5m2``): max 57344, subnormals down to 2**-16. Rounding is
  torch's own cast (RNE, checked bit for bit in the tests); we clamp first so the result
  does not depend on whether a torch version's cast saturates.
- E2M1 (FP4, OCP MX spec table 5): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf/NaN.
  The grid spacing is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6], and within each stretch
  the code's mantissa bit alternates with the grid index, so ``round`` (which rounds half
  to even) on the stretch's own spacing is exactly RNE on the E2M1 codes.
- E8M0 (``torch.float8_e8m0fnu``, MX scales): 2**(b - 127) for biased b in 0..254; b = 255
  is NaN; no zero, no sign.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoprec.errors import InputError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu

#: Largest finite magnitude of each element format.
ELEM_MAX: dict[torch.dtype | str, float] = {E4M3: 448.0, E5M2: 57344.0, "e2m1": 6.0}
#: emax_elem of the OCP MX spec (table 1): the exponent of the largest power of two
#: representable in the element format (448 = 1.75 * 2**8, 57344 = 1.75 * 2**15, 6 = 1.5 * 2**2).
ELEM_EMAX: dict[torch.dtype | str, int] = {E4M3: 8, E5M2: 15, "e2m1": 2}

E8M0_BIAS = 127
E8M0_NAN = 255
#: E8M0 exponents: -127..127 (biased 0..254); the spec's scale range, section 5.4.
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127

#: E2M1 magnitudes by code (bit 3 is the sign): OCP MX spec v1.0, table 5.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class NumericFormat:
    """Range and resolution of one storage/compute format (a block format's: its elements')."""

    name: str
    max: float
    smallest_normal: float
    mantissa_bits: int  # explicit bits

    @property
    def eps(self) -> float:
        """Unit roundoff: half the spacing of values in [1, 2)."""
        return 2.0 ** -(self.mantissa_bits + 1)


class BlockShapeError(InputError, ValueError):
    """The reduction dim is not a multiple of the format's block size (the eligibility rule)."""


def to_blocks(x: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """``x`` (..., K) viewed as (..., K // block, block) in fp32; K must divide by ``block``."""
    if x.dim() == 0:
        raise BlockShapeError(f"{fmt}: needs at least one dimension, got a scalar")
    k = x.shape[-1]
    if k % block:
        raise BlockShapeError(
            f"{fmt}: the last (reduction) dim K must be a multiple of the block size {block}, "
            f"but got K={k} (shape {tuple(x.shape)})"
        )
    return x.float().reshape(*x.shape[:-1], k // block, block)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2**e in fp32 for integer e in [-127, 127], built from the bit pattern.

    2**-127 is a fp32 subnormal (bits 0x00400000); every other value is a normal with
    biased exponent e + 127. ``torch.exp2`` would do for most e, but this is exact by
    construction on every backend.
    """
    e = e.to(torch.int32)
    normal = torch.bitwise_left_shift(e + 127, 23)
    sub = torch.full_like(e, 1 << 22)  # 2**-127 = 2**-149 * 2**22
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def e8m0_from_exponent(e: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """E8M0 scales 2**e (e already clamped to -127..127); NaN where ``nan`` is True."""
    biased = (e.to(torch.int32) + E8M0_BIAS).to(torch.uint8)
    if nan is not None:
        biased = torch.where(nan, torch.full_like(biased, E8M0_NAN), biased)
    return biased.view(E8M0)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """fp32 values of E8M0 scales (2**(b-127), NaN for b = 255), exact."""
    b = s.view(torch.uint8).to(torch.int32)
    val = pow2((b - E8M0_BIAS).clamp(min=E8M0_MIN_EXP, max=E8M0_MAX_EXP))
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def cast_fp8(x: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """fp32 -> fp8 (``dtype``), RNE with saturation to ±max; NaN stays NaN, ±inf saturates."""
    m = ELEM_MAX[dtype]
    return x.float().clamp(-m, m).to(dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded onto the E2M1 grid (RNE, saturating at ±6), as fp32.

    NaN stays NaN (E2M1 has no NaN: callers make the whole tensor NaN instead).
    """
    x = x.float()
    a = x.abs().clamp_(max=6.0)
    # The grid's step is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]: adding M = 2**22, 2**23 or
    # 2**24 (whose fp32 ulp is that step) rounds ``a`` to it, RNE, in the FPU's own add; M is
    # built from a's exponent field clamped to 1's..4's (below 1: 1's). NaN stays NaN.
    magic = (a.view(torch.int32) >> 23).clamp_(127, 129).add_(22).bitwise_left_shift_(23)
    m = magic.view(torch.float32)
    return torch.copysign(a.add_(m).sub_(m), x)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15, bit 3 = sign) of values already on the E2M1 grid."""
    a = v.abs()
    mag = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0))
    sign = torch.signbit(v).to(torch.uint8) << 3
    return mag.to(torch.uint8) | sign


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes (uint8, low nibble used)."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    c = codes.to(torch.int64)
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) codes -> (..., K // 2) ``torch.float4_e2m1fn_x2``: element 2i in the low
    nibble, 2i + 1 in the high nibble (torch's and cuBLAS's packing)."""
    if codes.shape[-1] % 2:
        raise BlockShapeError(f"e2m1 packing: the last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: (..., K // 2) packed -> (..., K) uint8 codes."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


__all__ = [
    "E2M1_VALUES", "E4M3", "E5M2", "E8M0", "ELEM_EMAX", "ELEM_MAX", "BlockShapeError",
    "NumericFormat",
    "cast_fp8", "e2m1_codes", "e2m1_values", "e8m0_from_exponent", "e8m0_to_float",
    "pack_e2m1", "pow2", "round_e2m1", "to_blocks", "unpack_e2m1",
]
