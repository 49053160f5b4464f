"""The GEMM number formats: fp8 (per-tensor scale), MXFP8 (OCP MX v1.0) and NVFP4, by emulation.

Pure numerics: quantise, dequantise and fake-quantise (block formats along the last dim, the
GEMM's reduction dim K). What each format is and which layers may run it: ``gemm``. The
Linear backends that use them live in ``autoprec.lower.fp8`` / ``autoprec.lower.blockscale``.

- ``fp8``: :func:`quantize_fp8`, :func:`dequantize_fp8`, :func:`fake_quant_fp8` (per-tensor
  current scaling).
- ``mx``: :func:`quantize_mx`, :func:`dequantize_mx`, :func:`fake_quant_mxfp8`.
- ``nvfp4``: :func:`quantize_nvfp4`, :func:`dequantize_nvfp4`, :func:`fake_quant_nvfp4`.
- ``nvfp4_train``: the quantisers of NVIDIA's NVFP4 training recipe (1x16 blocks with
  stochastic rounding, 16x16 weight tiles, the random Hadamard transform of the wgrad operands).
- ``elements``: the E4M3/E5M2/E2M1/E8M0 codecs, all RNE with saturation.
- ``layout``: the cuBLAS block-scale swizzle (128x4 tiles) the real kernels read.
- ``gemm``: :class:`GemmFormat`, one object per format holding its facts (forward-only or
  its gradient recipe, element and scale types and widths, bytes per element, block size,
  alignment rules, the quantisation passes and their cost, which layers may run it); the
  one Linear-like predicate (:func:`~autoprec.formats.gemm.is_linear_like`).

How to add a GEMM format
------------------------
Every stage asks the format object (``format_of`` / ``gemm_format``) and no module outside
``formats/`` and ``lower/`` compares a format's name (tests/packaging/test_format_strings.py),
so a new block-scaled format (say ``mxfp4``) touches these files and no others:

1. ``autoprec/formats/<numerics>.py`` (``mx.py`` for an MX format, or a new module beside
   it; ``elements.py`` too if its element needs a new codec): quantise / dequantise /
   fake-quantise along K.
2. ``autoprec/formats/gemm.py``: its :class:`GemmFormat` in ``GEMM_FORMAT_BY_NAME`` (the
   order there is the precisions' order): element, scale, block, gradient recipe (None:
   forward-only), bytes per element, amax passes, alignment extras, element range and bits,
   test tolerance, the torch dtypes and ``scaled_mm`` recipe it needs. ``precisions``
   (``GEMM_FORMATS``, ``PRECISIONS``, ``FORMATS``, ``BYTES``, ``TOLERANCES``), the
   capability check, the tracer, probes, plan, cost model, search, apply and plots read it.
3. ``autoprec/formats/precisions.py``: its name in the ``Precision`` Literal (typing only; a test
   keeps it equal to ``PRECISIONS``).
4. ``autoprec/lower/blockscale.py``: its backend — the emulated fake-quant GEMM and the real
   ``torch.nn.functional.scaled_mm`` call (and the backward, unless forward-only).
5. ``autoprec/lower/stored.py``: the deploy form's stored weight (``stored_weight`` /
   ``dequantized_weight``).
6. ``autoprec/cost/devices.yaml``: its GEMM peak on each device that runs it (a device
   without one cannot run it, with a reason).

Optional: a colour in ``autoprec/track/plots.py`` (else the shared "other" one). A
per-tensor-scaled format like fp8 would instead take a backend beside ``lower/fp8.py``,
its dispatch in ``lower/backends.py`` and its backend check in ``autoprec/device/capability.py``.
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
