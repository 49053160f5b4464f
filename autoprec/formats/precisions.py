"""The precisions autoprec searches over, their numeric formats and test tolerances.

Format limits are the IEEE/OCP definitions:
- fp16 (IEEE binary16): max 65504, smallest normal 2**-14, 10 explicit mantissa bits.
- bf16: fp32's exponent range, 7 explicit mantissa bits (8 with the implicit one).
- tf32: fp32 range, 10 explicit mantissa bits (NVIDIA Ampere whitepaper).
- fp8 e4m3fn: max 448, smallest normal 2**-6, 3 mantissa bits;
  fp8 e5m2: max 57344, smallest normal 2**-14, 2 mantissa bits
  (OCP 8-bit Floating Point Specification, 2023).
- mxfp8: e4m3 elements sharing one E8M0 (power-of-two) scale per 32 along K (OCP
  Microscaling Formats spec v1.0); nvfp4: E2M1 elements (max 6, 1 mantissa bit), one E4M3
  scale per 16 along K times a per-tensor fp32 scale (NVIDIA). Both are block-scaled: their
  FORMATS entries describe the elements; the scales give them fp32's range.

Regions and GEMM formats: fp32/tf32/bf16/fp16 are *regions* (what a module's own code
runs in: autocast or not); fp8/mxfp8/nvfp4 are *GEMM formats* (a module backend for
Linear-like leaves; the leaf takes and gives its region's dtype).
"""

from __future__ import annotations

from typing import Literal

import torch

from autoprec.errors import InputError
from autoprec.formats.elements import NumericFormat
from autoprec.formats.gemm import GEMM_FORMAT_BY_NAME

Precision = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]

#: What a module's own code can run in.
REGIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
#: Module backends for Linear-like leaves (not autocast regions): the format objects'
#: names, in their order (``autoprec.formats.gemm``, where each one's facts live).
GEMM_FORMATS: tuple[str, ...] = tuple(GEMM_FORMAT_BY_NAME)
#: Ordered from most to least precise; the search and reports use this order.
PRECISIONS: tuple[str, ...] = (*REGIONS, *GEMM_FORMATS)

#: Precisions expressible by ``torch.autocast``.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: The two forms a plan runs in (docs/overview.md, "Execution plan"):
#: - ``deploy``: each module's weights stored once in the dtype of its region (bf16/fp16
#:   layers hold 16-bit weights, as ``model.to(torch.bfloat16)`` does; GEMM-format leaves
#:   hold their quantised weight and scales; fp32/tf32 layers keep fp32), activations flow
#:   in each region's dtype, casts only at region boundaries, no autocast. For inference.
#: - ``train``: autocast regions over fp32 master weights (a 16-bit layer casts its weight
#:   on every call; gradients, GradScaler). For training, and what a policy file without
#:   ``form:`` means (files written before the deploy form existed).
FORMS: tuple[str, ...] = ("deploy", "train")
#: The form of a policy file that names none.
LEGACY_FORM = "train"
#: Region precision -> the dtype its tensors are stored in under the deploy form.
STORAGE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "tf32": torch.float32,
                                          "bf16": torch.bfloat16, "fp16": torch.float16}


FORMATS: dict[str, NumericFormat] = {
    "fp32": NumericFormat("fp32", float(torch.finfo(torch.float32).max), 2.0**-126, 23),
    "tf32": NumericFormat("tf32", float(torch.finfo(torch.float32).max), 2.0**-126, 10),
    "bf16": NumericFormat("bf16", float(torch.finfo(torch.bfloat16).max), 2.0**-126, 7),
    "fp16": NumericFormat("fp16", 65504.0, 2.0**-14, 10),
    # the GEMM formats' elements (fp8 forward; its gradients: FP8_E5M2 below)
    **{n: f.numeric for n, f in GEMM_FORMAT_BY_NAME.items()},
}
FP8_E5M2 = NumericFormat("fp8_e5m2", 57344.0, 2.0**-14, 2)

#: Bytes per element as stored/moved on the device (tf32 is stored as fp32); a GEMM format's
#: is its own fact, scales included (``GemmFormat.bytes_per_element``: mxfp8 1 + 1/32,
#: nvfp4 1/2 + 1/16).
BYTES: dict[str, float] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2,
                           **{n: f.bytes_per_element for n, f in GEMM_FORMAT_BY_NAME.items()}}

#: One tolerance table for every numerics test (after Transformer Engine's dtype_tols):
#: (rtol, atol) for comparing a single lowered op against a reference computed by hand
#: with explicit casts of the same operands.
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1.3e-6, 1e-5),
    "tf32": (1e-3, 1e-4),
    "bf16": (1.6e-2, 1e-3),
    "fp16": (1e-3, 1e-4),
    **{n: f.tolerance for n, f in GEMM_FORMAT_BY_NAME.items()},
}


def dtype_tols(precision: str) -> dict[str, float]:
    """Keyword arguments for ``torch.testing.assert_close`` at ``precision``."""
    rtol, atol = TOLERANCES[check_precision(precision)]
    return {"rtol": rtol, "atol": atol}


def check_precision(name: str, where: str = "") -> str:
    """Return ``name`` if it is a known precision, else raise InputError naming it."""
    if name not in PRECISIONS:
        loc = f"{where}: " if where else ""
        raise InputError(
            f"{loc}unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}"
        )
    return name


def parse_precisions(text: str | None) -> tuple[str, ...] | None:
    """Parse a ``--precisions fp16,bf16`` list; ``None`` means 'all the device supports'."""
    if text is None:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise InputError(f"--precisions: give at least one of {', '.join(PRECISIONS)}")
    for n in names:
        check_precision(n, "--precisions")
    # keep the canonical order, drop duplicates
    return tuple(p for p in PRECISIONS if p in names)


def rank(precision: str) -> int:
    """0 for fp32 (most precise) … 6 for nvfp4."""
    return PRECISIONS.index(precision)


def is_gemm_format(precision: str) -> bool:
    """fp8 / mxfp8 / nvfp4: a Linear backend, not a region."""
    return precision in GEMM_FORMATS


def carrier_of(precision: str, region: str) -> str:
    """The precision whose range a layer's inputs and output live in: its own, or its
    region's for a GEMM format (fp8 / mxfp8 / nvfp4 scale their operands per call and give
    their input's dtype: e4m3's 448 does not bind, the region's dtype does)."""
    return region if is_gemm_format(precision) else precision
