"""autoprec's GEMM formats as compressed-tensors 0.20 schemes, and their scales in its
convention.

compressed-tensors dequantises ``x = q * scale`` (``/ global_scale`` for NVFP4's two
levels); autoprec stores fp8 as ``x = q / scale`` (``formats.fp8``), MXFP8 as E8M0 block
exponents, NVFP4 as ``x = q * tensor_scale * block_scale`` (``formats.nvfp4``). The schemes
are the library's presets, written out (``compressed_tensors.quantization.quant_scheme``):

| autoprec | weights | input activations | compressed-tensors format |
|---|---|---|---|
| fp8 | 8-bit float, per tensor, fp32 scale | 8-bit float, per tensor, dynamic | float-quantized |
| mxfp8 | 8-bit float, group 32, uint8 (E8M0) scale | 8-bit float, group 32, dynamic | mxfp8-quantized |
| nvfp4 | 4-bit float, tensor_group 16, fp8 e4m3 scale + fp32 global | the same, local scales dynamic, global static | nvfp4-pack-quantized |

autoprec's fp8 weight and activation scales are per tensor from the current amax — the
``FP8`` preset's weights with ``FP8_DYNAMIC``'s dynamic activations at tensor
granularity. NVFP4's activation global scale is static in compressed-tensors (``dynamic:
local``): it is set from the amax of the layer's inputs over the calibration batches,
where autoprec takes each call's amax.
"""

from __future__ import annotations

from typing import Any

import torch

#: autoprec format -> the compressed-tensors format its layers are written in.
CT_FORMAT = {"fp8": "float-quantized", "mxfp8": "mxfp8-quantized",
             "nvfp4": "nvfp4-pack-quantized"}
#: NVFP4's two-level maximum (E4M3 block scale max 448 * E2M1 max 6).
_NVFP4_MAX = 448.0 * 6.0


def scheme_for(fmt: str, targets: list[str]) -> Any:
    """The compressed-tensors ``QuantizationScheme`` of ``fmt`` for layer names ``targets``."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )
    from compressed_tensors.quantization.quant_args import DynamicType

    fl = QuantizationType.FLOAT
    if fmt == "fp8":
        w = QuantizationArgs(num_bits=8, type=fl, strategy=QuantizationStrategy.TENSOR,
                             symmetric=True, dynamic=False)
        a = QuantizationArgs(num_bits=8, type=fl, strategy=QuantizationStrategy.TENSOR,
                             symmetric=True, dynamic=True)
    elif fmt == "mxfp8":
        w = QuantizationArgs(num_bits=8, type=fl, strategy=QuantizationStrategy.GROUP,
                             symmetric=True, dynamic=False, group_size=32,
                             scale_dtype=torch.uint8, zp_dtype=torch.uint8)
        a = QuantizationArgs(num_bits=8, type=fl, strategy=QuantizationStrategy.GROUP,
                             symmetric=True, dynamic=True, group_size=32,
                             scale_dtype=torch.uint8, zp_dtype=torch.uint8)
    elif fmt == "nvfp4":
        e4m3 = torch.float8_e4m3fn
        w = QuantizationArgs(num_bits=4, type=fl, strategy=QuantizationStrategy.TENSOR_GROUP,
                             symmetric=True, dynamic=False, group_size=16,
                             scale_dtype=e4m3, zp_dtype=e4m3)
        a = QuantizationArgs(num_bits=4, type=fl, strategy=QuantizationStrategy.TENSOR_GROUP,
                             symmetric=True, dynamic=DynamicType.LOCAL, group_size=16,
                             observer="static_minmax", scale_dtype=e4m3, zp_dtype=e4m3)
    else:
        raise ValueError(f"no compressed-tensors scheme for {fmt!r}")
    return QuantizationScheme(targets=list(targets), weights=w, input_activations=a,
                              format=CT_FORMAT[fmt])


def ct_scales(own: dict[str, torch.Tensor], fmt: str, input_amax: float | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """From a deployed layer's tensors (``own``: ``weight`` = autoprec's stored elements,
    ``weight_scale`` [, ``weight_scale_2``]): its fp32 weight values exactly as
    compressed-tensors dequantises them, and the scale parameters in its convention —
    so its compression gives back autoprec's very elements."""
    from autoprec.formats.elements import e2m1_values, e8m0_to_float
    from autoprec.lower.stored import SCALE, SCALE_2

    q, s = own["weight"], own[SCALE]
    if fmt == "fp8":
        ct = (1.0 / s.float()).reshape(1)  # autoprec x = q / s; compressed-tensors x = q * ct
        return q.float() * ct, {"weight_scale": ct}
    if fmt == "mxfp8":
        scale = e8m0_to_float(s)  # (N, K // 32), exact powers of two
        n, k = q.shape
        values = (q.float().reshape(n, k // 32, 32) * scale.unsqueeze(-1)).reshape(n, k)
        return values, {"weight_scale": scale}
    g = own[SCALE_2].float().reshape(())  # decode scale amax / (448 * 6)
    glob = (1.0 / g).reshape(1)
    n, k = q.shape
    blocks = s.float()  # (N, K // 16), E4M3 values
    values = (e2m1_values(q).reshape(n, k // 16, 16)
              * (blocks / glob).unsqueeze(-1)).reshape(n, k)
    scales = {"weight_scale": s, "weight_global_scale": glob}
    if input_amax is not None and input_amax > 0:
        scales["input_global_scale"] = torch.tensor([_NVFP4_MAX / input_amax])
    return values, scales


__all__ = ["CT_FORMAT", "ct_scales", "scheme_for"]
