"""The GEMM number formats: fp8 (per-tensor scale), MXFP8 (OCP MX v1.0) and NVFP4, by emulation.

Pure numerics: quantise, dequantise and fake-quantise (block formats along the last dim, the
GEMM's reduction dim K). What each format is and which layers may run it: ``gemm``. The
Linear backends that use them live in ``autoprec.lower.fp8`` / ``autoprec.lower.blockscale``.

- ``fp8``: :func:`quantize_fp8`, :func:`dequantize_fp8`, :func:`fake_quant_fp8` (per-tensor
  current scaling).
- ``mx``: :func:`quantize_mx`, :func:`dequantize_mx`, :func:`fake_quant_mxfp8`.
- ``nvfp4``: :func:`quantize_nvfp4`, :func:`dequantize_nvfp4`, :func:`fake_quant_nvfp4`.
- ``elements``: the E4M3/E5M2/E2M1/E8M0 codecs, all RNE with saturation.
- ``layout``: the cuBLAS block-scale swizzle (128x4 tiles) the real kernels read.
"""

import torch

from autoprec.formats.elements import BlockShapeError
from autoprec.formats.fp8 import dequantize_fp8, fake_quant_fp8, quantize_fp8
from autoprec.formats.gemm import (
    BLOCK_SCALED,
    GEMM_FORMAT_BY_NAME,
    GemmFormat,
    format_of,
    gemm_format,
)
from autoprec.formats.mx import (
    MX_BLOCK,
    MXTensor,
    dequantize_mx,
    fake_quant_mx,
    fake_quant_mxfp8,
    quantize_mx,
)
from autoprec.formats.nvfp4 import (
    NVFP4_BLOCK,
    NVFP4Tensor,
    dequantize_nvfp4,
    fake_quant_nvfp4,
    nvfp4_tensor_scale,
    quantize_nvfp4,
)


def fake_quant_block(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` rounded through ``fmt`` ("mxfp8" or "nvfp4") along its last dim, fp32."""
    if fmt == "mxfp8":
        return fake_quant_mxfp8(x)
    if fmt == "nvfp4":
        return fake_quant_nvfp4(x)
    raise ValueError(f"unknown block-scaled format {fmt!r}; expected one of {BLOCK_SCALED}")


__all__ = [
    "BLOCK_SCALED", "GEMM_FORMAT_BY_NAME", "GemmFormat", "MX_BLOCK", "NVFP4_BLOCK", "BlockShapeError", "MXTensor",
    "NVFP4Tensor", "dequantize_fp8", "dequantize_mx", "dequantize_nvfp4", "fake_quant_block",
    "fake_quant_fp8", "fake_quant_mx", "fake_quant_mxfp8", "fake_quant_nvfp4",
    "format_of", "gemm_format", "nvfp4_tensor_scale", "quantize_fp8", "quantize_mx", "quantize_nvfp4",
]
