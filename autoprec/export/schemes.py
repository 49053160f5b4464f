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


def _args(**kw: Any) -> Any:
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(symmetric=True, type="float", **kw)


def _fp8_args() -> tuple[Any, Any]:
    # per-tensor weight scale; per-tensor activation scale from each call's amax
    return (_args(num_bits=8, strategy="tensor", dynamic=False),
            _args(num_bits=8, strategy="tensor", dynamic=True))


def _mxfp8_args() -> tuple[Any, Any]:
    u8 = torch.uint8  # E8M0 exponents
    return (_args(num_bits=8, strategy="group", group_size=32, dynamic=False,
                  scale_dtype=u8, zp_dtype=u8),
            _args(num_bits=8, strategy="group", group_size=32, dynamic=True,
                  scale_dtype=u8, zp_dtype=u8))


def _nvfp4_args() -> tuple[Any, Any]:
    from compressed_tensors.quantization.quant_args import DynamicType

    e4m3 = torch.float8_e4m3fn
    return (_args(num_bits=4, strategy="tensor_group", group_size=16, dynamic=False,
                  scale_dtype=e4m3, zp_dtype=e4m3),
            _args(num_bits=4, strategy="tensor_group", group_size=16,
                  dynamic=DynamicType.LOCAL, observer="static_minmax", scale_dtype=e4m3,
                  zp_dtype=e4m3))


def _fp8_scales(own: dict[str, torch.Tensor], _amax: float | None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from autoprec.lower.stored import SCALE

    q, s = own["weight"], own[SCALE]
    ct = (1.0 / s.float()).reshape(1)  # autoprec x = q / s; compressed-tensors x = q * ct
    return q.float() * ct, {"weight_scale": ct}


def _mxfp8_scales(own: dict[str, torch.Tensor], _amax: float | None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from autoprec.formats.elements import e8m0_to_float
    from autoprec.lower.stored import SCALE

    q = own["weight"]
    scale = e8m0_to_float(own[SCALE])  # (N, K // 32), exact powers of two
    n, k = q.shape
    values = (q.float().reshape(n, k // 32, 32) * scale.unsqueeze(-1)).reshape(n, k)
    return values, {"weight_scale": scale}


def _nvfp4_scales(own: dict[str, torch.Tensor], input_amax: float | None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from autoprec.formats.elements import e2m1_values
    from autoprec.lower.stored import SCALE, SCALE_2

    q, s = own["weight"], own[SCALE]
    g = own[SCALE_2].float().reshape(())  # decode scale amax / (448 * 6)
    glob = (1.0 / g).reshape(1)
    n, k = q.shape
    values = (e2m1_values(q).reshape(n, k // 16, 16)
              * (s.float() / glob).unsqueeze(-1)).reshape(n, k)
    scales = {"weight_scale": s, "weight_global_scale": glob}
    if input_amax is not None and input_amax > 0:
        scales["input_global_scale"] = torch.tensor([_NVFP4_MAX / input_amax])
    return values, scales


#: format -> (weight args, input-activation args) of its compressed-tensors scheme.
_ARGS = {"fp8": _fp8_args, "mxfp8": _mxfp8_args, "nvfp4": _nvfp4_args}
#: format -> its scales in compressed-tensors' convention.
_SCALES = {"fp8": _fp8_scales, "mxfp8": _mxfp8_scales, "nvfp4": _nvfp4_scales}
#: format -> whether its scheme has a static activation scale to measure on calibration
#: batches (NVFP4's input_global_scale; compressed-tensors has no dynamic one for it).
STATIC_ACTIVATION_SCALE = {"fp8": False, "mxfp8": False, "nvfp4": True}


def scheme_for(fmt: str, targets: list[str]) -> Any:
    """The compressed-tensors ``QuantizationScheme`` of ``fmt`` for layer names ``targets``."""
    from compressed_tensors.quantization import QuantizationScheme

    if fmt not in _ARGS:
        raise ValueError(f"no compressed-tensors scheme for {fmt!r}")
    w, a = _ARGS[fmt]()
    return QuantizationScheme(targets=list(targets), weights=w, input_activations=a,
                              format=CT_FORMAT[fmt])


def ct_scales(own: dict[str, torch.Tensor], fmt: str, input_amax: float | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """From a deployed layer's tensors (``own``: ``weight`` = autoprec's stored elements,
    ``weight_scale`` [, ``weight_scale_2``]): its fp32 weight values exactly as
    compressed-tensors dequantises them, and the scale parameters in its convention —
    so its compression gives back autoprec's very elements."""
    return _SCALES[fmt](own, input_amax)


__all__ = ["CT_FORMAT", "STATIC_ACTIVATION_SCALE", "ct_scales", "scheme_for"]
