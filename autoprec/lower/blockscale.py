"""Block-scaled Linear backends: MXFP8 and NVFP4 GEMMs for Linear-like layers.

``blockscaled_linear(module, x, fmt)`` computes ``y = q(x) q(W)^T + b``: x (..., K) and the
weight (N, K) are both quantised along K (the reduction dim) with the format's blocks
(MXFP8: 32 elements, E8M0 scale; NVFP4: 16 elements, E4M3 scale x per-tensor fp32; see
``autoprec.formats``), multiplied with fp32 accumulation (as the tensor cores do), the
bias added in fp32, and the result returned in the input's dtype (or the autocast dtype
when one is active), as ``fp8.fp8_linear`` does.

Backends:
- ``emulated``: quantise-dequantise and an fp32 matmul. Runs anywhere; for accuracy.
- ``torchao`` (mxfp8, the train form where the block-scaled kernels run): torchao's
  MXFP8 training GEMMs, fprop, dgrad and wgrad (``lower.torchao_fp8``).
- ``torch``: ``torch.nn.functional.scaled_mm`` (torch >= 2.10's public scaled GEMM) with
  ``ScalingType.BlockWise1x32`` + E8M0 scales (MXFP8) or ``BlockWise1x16`` E4M3 scales plus
  a ``TensorWise`` fp32 scale (NVFP4), scales in the cuBLAS 128x4 swizzle
  (``SwizzleType.SWIZZLE_32_4_4``). Needs CUDA SM >= 10.0 (Blackwell) and CUDA >= 12.8
  (``blockscale_capability`` says why not).

Training (gradient recipes):
- mxfp8: the MXFP8 recipe of Transformer Engine (``MXFP8BlockScaling``, E4M3 for every
  tensor) and torchao's MXLinear: each backward GEMM re-quantises its operands from the
  saved high-precision tensors along *its own* reduction dim — dX = q_N(dY) q_N(W)
  (blocks along N), dW = q_M(dY^T) q_M(X) (blocks along the tokens M) — fp32 accumulate;
  the bias gradient is the fp32 sum of dY. A dim that is not a multiple of 32 is padded
  with zeros (zeros do not change a block's amax: a partial last block).
- nvfp4: the forward GEMM here (1x16 weight blocks, as NVFP4 inference stores them) has
  no backward: a backward through it raises :class:`NoGradientRecipe`. Training runs
  NVIDIA's NVFP4 recipe instead (16x16 weight blocks, stochastic rounding of the
  gradients, a random Hadamard transform on the wgrad operands): the ``train-emulated`` /
  ``train-torch`` backends of ``lower.nvfp4_train``, which the train form picks
  (``backends.linear`` dispatches to them).
"""

from __future__ import annotations

from typing import Any

import torch

from autoprec.device.capability import BLOCK_BACKENDS, blockscale_capability
from autoprec.errors import CapabilityError
from autoprec.formats import BlockShapeError
from autoprec.formats.elements import pack_e2m1
from autoprec.formats.fp8 import row_chunks
from autoprec.formats.gemm import BLOCK_SCALED, gemm_format, ineligible_reason, linear_weight
from autoprec.formats.layout import to_blocked
from autoprec.formats.mx import (
    MX_SCALE_MODE,
    MXTensor,
    dequantize_mx,
    fake_quant_mxfp8,
    fake_quant_mxfp8_padded,
    quantize_mx,
)
from autoprec.formats.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    fake_quant_nvfp4,
    nvfp4_tensor_scale,
    quantize_nvfp4,
)
from autoprec.lower.autocast import compute_dtype
from autoprec.lower.weight_cache import weight_cache_allowed


class NoGradientRecipe(CapabilityError, RuntimeError):
    """A backward pass reached a forward-only GEMM (nvfp4's inference GEMM)."""


def _check_fmt(fmt: str) -> str:
    if fmt not in BLOCK_SCALED:
        raise ValueError(f"unknown block-scaled format {fmt!r}; expected one of "
                         f"{', '.join(BLOCK_SCALED)}")
    return fmt


# --- the GEMMs ------------------------------------------------------------------------


def _fake_quant(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return fake_quant_mxfp8(t, MX_SCALE_MODE) if fmt == "mxfp8" else fake_quant_nvfp4(t)


def _pad_rows(x2: torch.Tensor, multiple: int = 16) -> tuple[torch.Tensor, int]:
    m = x2.shape[0]
    pad = (-m) % multiple
    return (torch.cat([x2, x2.new_zeros(pad, x2.shape[1])]) if pad else x2), m


def scaled_mm_call(xq: Any, wq: Any, fmt: str,
                   out_dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments of ``torch.nn.functional.scaled_mm`` for quantised (M, K) x (N, K) operands.

    MXFP8: e4m3 data, E8M0 scales swizzled, ``BlockWise1x32`` both sides. NVFP4: packed
    fp4x2 data, [E4M3 block scales swizzled, fp32 tensor scale] with [``BlockWise1x16``,
    ``TensorWise``] (torch 2.13's ``is_nv`` case in ``_check_scaled_mm_sizes_v2``). The
    second operand is the weight transposed (column-major), as cuBLAS wants. Scales are
    decode factors (dequantised = data x scale), which is what scaled_mm takes.
    """
    F = torch.nn.functional
    st, sw = F.ScalingType, F.SwizzleType
    if fmt == "mxfp8":
        return ((xq.data, wq.data.t(), to_blocked(xq.scale), st.BlockWise1x32,
                 to_blocked(wq.scale), st.BlockWise1x32),
                {"swizzle_a": sw.SWIZZLE_32_4_4, "swizzle_b": sw.SWIZZLE_32_4_4,
                 "output_dtype": out_dtype})
    recipe = [st.BlockWise1x16, st.TensorWise]
    swz = [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
    return ((pack_e2m1(xq.codes), pack_e2m1(wq.codes).t(),
             [to_blocked(xq.block_scale), xq.tensor_scale.reshape(1)], recipe,
             [to_blocked(wq.block_scale), wq.tensor_scale.reshape(1)], recipe),
            {"swizzle_a": swz, "swizzle_b": swz, "output_dtype": out_dtype})


def _real_mm(x2: torch.Tensor, wq: Any, fmt: str, out_dtype: torch.dtype) -> torch.Tensor:
    """(M, K) fp32 activations @ a quantised (N, K) weight via ``F.scaled_mm`` -> (M, N).

    Rows are zero-padded to a multiple of 16 (zero rows quantise to zero and leave every
    other block's scale unchanged); the swizzled scales pad themselves to 128 rows.
    """
    xp, m = _pad_rows(x2)
    xq = quantize_mx(xp, scale_mode=MX_SCALE_MODE) if fmt == "mxfp8" else quantize_nvfp4(xp)
    args, kwargs = scaled_mm_call(xq, wq, fmt, out_dtype)
    return torch.nn.functional.scaled_mm(*args, **kwargs)[:m]


def _forward(x2: torch.Tensor, wcache: Any, fmt: str, backend: str,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The forward GEMM in fp32 (M, N): emulated reads the fake-quantised weight."""
    if backend == "torch":
        gemm_out = torch.float32 if out_dtype == torch.float32 else torch.bfloat16
        return _real_mm(x2, wcache, fmt, gemm_out).float()
    xq = _fake_quant(x2, fmt)
    if isinstance(wcache, _Pieces):  # a large weight: dequantised a piece of rows at a time
        return torch.cat([xq @ wcache.dequantized(i).t() for i in range(len(wcache.rows))],
                         dim=-1)
    return xq @ wcache.t()  # fp32 accumulate, like the GEMM


class _MXFP8LinearFn(torch.autograd.Function):
    """y = q32(x) q32(W)^T (+ b); backward re-quantises along each GEMM's reduction dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                backend: str, out_dtype: torch.dtype, wcache: Any) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # (M, K)
        y = _forward(x2, wcache, "mxfp8", backend, out_dtype)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.in_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y.to(out_dtype).reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        x2, weight = ctx.saved_tensors  # (M, K), (N, K)
        g = grad_out.reshape(-1, grad_out.shape[-1]).float()  # (M, N)
        w = weight.float()
        fq = fake_quant_mxfp8_padded
        grad_x = fq(g) @ fq(w.t()).t()  # dX (M, K): reduce over N
        grad_w = fq(g.t()) @ fq(x2.t()).t()  # dW (N, K): reduce over M
        grad_b = g.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return (grad_x.to(ctx.in_dtype).reshape(*grad_out.shape[:-1], -1),
                grad_w.to(ctx.w_dtype), grad_b, None, None, None)


class _NVFP4LinearFn(torch.autograd.Function):
    """y = q16(x) q16(W)^T (+ b), the inference GEMM: backward raises NoGradientRecipe."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                backend: str, out_dtype: torch.dtype, wcache: Any) -> torch.Tensor:
        shape = x.shape
        y = _forward(x.reshape(-1, shape[-1]).float(), wcache, "nvfp4", backend, out_dtype)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype).reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        raise NoGradientRecipe(
            "nvfp4's inference GEMM (1x16 weight blocks) is forward-only: training runs "
            "NVIDIA's NVFP4 recipe (the train form: prepare_training, or the backend "
            "'train-emulated' / 'train-torch')")


def _quantize_weight(weight: torch.Tensor, fmt: str, backend: str) -> Any:
    """The weight as the GEMM reads it: fake-quantised fp32 (emulated) or quantised (torch)."""
    if backend == "torch":
        w = weight.detach().float()
        return quantize_mx(w, scale_mode=MX_SCALE_MODE) if fmt == "mxfp8" else quantize_nvfp4(w)
    w = weight.detach()
    if w.numel() <= PIECES_FROM:
        return _fake_quant(w.float(), fmt)
    return _Pieces(w, fmt, row_chunks(w))


#: A weight of more values than this (256 MB in fp32) is kept quantised in pieces of rows
#: (``_Pieces``) by the emulated GEMM; a smaller one as one fp32 fake-quant (faster: no
#: 4-bit codes to write and read back).
PIECES_FROM = 1 << 26


class _Pieces:
    """The emulated GEMM's weight when it is large: quantised a piece of rows at a time
    (``row_chunks``), kept quantised (1 byte a value with its scales, not the fp32 of a
    fake-quant) and dequantised a piece at a time as the GEMM reads it. The values are the
    whole tensor's: the blocks run along K, within a row, and NVFP4's per-tensor scale is
    taken from the whole tensor first; the GEMM's output is the whole GEMM's up to its
    last bits (each output's dot product is whole, but a smaller GEMM may sum it in another
    order), as ``fp8``'s emulated GEMM reads a large weight. An 8 B Llama's LM head (0.5 G values) took a 2 GB
    fp32 fake-quant plus several whole-size temporaries otherwise, per lowered call."""

    def __init__(self, w: torch.Tensor, fmt: str, rows: list[slice]) -> None:
        self.fmt, self.rows = fmt, rows
        g = nvfp4_tensor_scale(w) if fmt == "nvfp4" else None
        self.quantized = [quantize_mx(w[r].float(), scale_mode=MX_SCALE_MODE) if fmt == "mxfp8"
                          else quantize_nvfp4(w[r].float(), g) for r in rows]

    def dequantized(self, i: int) -> torch.Tensor:
        q = self.quantized[i]
        return dequantize_mx(q) if isinstance(q, MXTensor) else dequantize_nvfp4(q)


def _weight_cache(module: torch.nn.Module, weight: torch.Tensor, fmt: str, backend: str) -> Any:
    """The quantised weight, cached on the module until the weight changes (its version
    moves at every optimizer step), as ``fp8._weight_fp8`` does; never under
    ``torch.distributed`` (``lower.weight_cache``)."""
    if torch.compiler.is_compiling() or not weight_cache_allowed():
        with torch.no_grad():
            return _quantize_weight(weight, fmt, backend)
    key = (weight.data_ptr(), weight._version, weight.device, tuple(weight.shape), fmt, backend)
    cached = module.__dict__.get("_autoprec_block_weight")
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        value = _quantize_weight(weight, fmt, backend)
    module.__dict__["_autoprec_block_weight"] = (key, value)
    return value


def blockscaled_linear(module: torch.nn.Module, x: torch.Tensor, fmt: str,
                       backend: str = "emulated") -> torch.Tensor:
    """Run a Linear-like ``module`` on ``x`` (..., K) in ``fmt`` ("mxfp8" / "nvfp4").

    Raises ``BlockShapeError`` (a ValueError) when K is not a multiple of the block,
    ``CapabilityError`` when ``backend`` cannot run here (with the reason).
    """
    _check_fmt(fmt)
    if backend == "torchao" and fmt == "mxfp8":  # torchao's MXFP8 training GEMMs
        from autoprec.lower.torchao_fp8 import torchao_mxfp8_linear

        return torchao_mxfp8_linear(module, x)
    if backend != "emulated":
        ok, why = blockscale_capability(fmt, backend, x.device)
        if not ok:
            raise CapabilityError(why)
    weight = linear_weight(module)
    if weight.shape[-1] % (gemm_format(fmt).block or 1):
        why = ineligible_reason(module, fmt)
        raise BlockShapeError(why or f"{fmt}: weight {tuple(weight.shape)} not block-aligned")
    bias = getattr(module, "bias", None)
    out_dtype = compute_dtype(x)
    fn = _MXFP8LinearFn if fmt == "mxfp8" else _NVFP4LinearFn
    with torch.autocast(x.device.type, enabled=False):
        return fn.apply(x, weight, bias, backend, out_dtype,
                        _weight_cache(module, weight, fmt, backend))


def reference_blockscaled_linear(x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """Hand reference for tests: explicit quantise/dequantise, no autograd.Function."""
    x2 = x.float().reshape(-1, x.shape[-1])
    if fmt == "mxfp8":
        xq = dequantize_mx(quantize_mx(x2, scale_mode=MX_SCALE_MODE))
        wq = dequantize_mx(quantize_mx(weight.float(), scale_mode=MX_SCALE_MODE))
    else:
        xq = dequantize_nvfp4(quantize_nvfp4(x2))
        wq = dequantize_nvfp4(quantize_nvfp4(weight.float()))
    y = xq @ wq.t()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], -1)


__all__ = ["BLOCK_BACKENDS", "MXTensor", "NVFP4Tensor", "NoGradientRecipe",
           "blockscale_capability", "blockscaled_linear",
           "reference_blockscaled_linear", "scaled_mm_call"]
