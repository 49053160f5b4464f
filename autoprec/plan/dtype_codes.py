"""The dtype codes of a replay (``autoprec.plan.schedule``) and the lookup tables over them.

A replay tracks the dtype of every value for T plans at once as small integer codes in numpy
arrays (one row per plan); the tables here turn region and precision codes
(``plan.compile.CODE``) into dtype codes and back with one gather each (``np.isin`` costs
~10 us a call, a gather ~1 us): what autocast produces in a region, what a GEMM computes in,
what a GEMM format reads its operands in, PyTorch's type promotion, the deploy form's
storage dtype.
"""

from __future__ import annotations

import numpy as np

from autoprec.formats.gemm import BLOCK_SCALED
from autoprec.formats.precisions import BYTES, GEMM_FORMATS
from autoprec.plan.compile import CODE, FORMAT_CODES

#: Value dtype codes ("fp8": a float8 tensor, trace.ops' name), then one per block-scaled
#: format (codes 6, 7...), only as what a block-scaled GEMM reads its operands in.
FP32, BF16, FP16, F8, FP64, OTHER = range(6)
DTYPES = ("fp32", "bf16", "fp16", "fp8", "fp64", "other", *BLOCK_SCALED)
_CODE = {n: i for i, n in enumerate(DTYPES[:6])}
#: Bytes per element of each code (OTHER: the value's own itemsize); block formats with
#: their scales (``GemmFormat.bytes_per_element``).
WIDTH = np.array([4, 2, 2, 1, 8, 0, *(BYTES[f] for f in BLOCK_SCALED)], dtype=float)
#: Region code (fp32, tf32, bf16, fp16) -> the dtype its autocast produces (fp32: none).
REGION_DTYPE = np.array([FP32, FP32, BF16, FP16, *[FP32] * len(GEMM_FORMATS)], dtype=np.int8)
#: dtype code -> the precision code a GEMM on it computes in (fp32 -> fp32; tf32 by region).
DTYPE_PREC = np.array([CODE["fp32"], CODE["bf16"], CODE["fp16"], CODE["fp8"], CODE["fp32"],
                       CODE["fp32"], *(CODE[f] for f in BLOCK_SCALED)], dtype=np.int8)
#: GEMM format precision code -> the dtype code its quantised operands are read in.
#: (the per-tensor fp8 reads float8 tensors, F8; each block format its own code, by name)
_OPERAND = {CODE[f]: DTYPES.index(f) for f in GEMM_FORMATS}


def _promotion_table() -> np.ndarray:
    """Result dtype of PyTorch's type promotion over a set of floating dtypes (bit mask)."""
    out = np.full(64, OTHER, dtype=np.int8)
    for mask in range(64):
        has = {c for c in range(6) if mask >> c & 1}
        floats = has - {OTHER}
        if FP64 in floats:
            out[mask] = FP64
        elif FP32 in floats or {BF16, FP16} <= floats:
            out[mask] = FP32
        elif BF16 in floats:
            out[mask] = BF16
        elif FP16 in floats:
            out[mask] = FP16
        elif F8 in floats:
            out[mask] = F8
    return out


PROMOTE = _promotion_table()
#: Norms whose output has their input's dtype whatever the dtype of their weight and bias
#: (aten's mixed-type norm kernels on a CPU: bf16 input, fp32 affine -> bf16 output).
MIXED_NORMS = frozenset({"native_layer_norm", "native_group_norm", "native_batch_norm",
                         "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"})


def fixed_code(name: str | None) -> int:
    """The code of a dtype as ``trace.ops`` names it (an integer or bool dtype: OTHER)."""
    return _CODE.get(name or "", OTHER)


_LOW = np.array([BF16, FP16], dtype=np.int8)
#: Lookup tables (np.isin costs ~10 us a call; a gather ~1 us): dtype code -> 16-bit;
#: precision code -> a GEMM format.
IS_LOW = np.isin(np.arange(len(DTYPES)), _LOW)
IS_FMT = np.isin(np.arange(len(CODE)), FORMAT_CODES)
#: Precision code -> the dtype code a GEMM format's operands are read in (F8 elsewhere).
OPERAND_OF = np.array([_OPERAND.get(c, F8) for c in range(len(CODE))], dtype=np.int8)

#: Region code -> the dtype code its tensors are stored in under the deploy form.
STORAGE = np.array([FP32, FP32, BF16, FP16, *[FP32] * len(GEMM_FORMATS)], dtype=np.int8)
#: dtype code -> a dtype the deploy form stores a tensor in (fp32, bf16, fp16).
CASTABLE = np.isin(np.arange(len(DTYPES)), (FP32, BF16, FP16))

__all__ = ["BF16", "CASTABLE", "DTYPES", "DTYPE_PREC", "F8", "FP16", "FP32", "FP64", "IS_FMT",
           "IS_LOW", "MIXED_NORMS", "OPERAND_OF", "OTHER", "PROMOTE", "REGION_DTYPE", "STORAGE",
           "WIDTH", "fixed_code"]
