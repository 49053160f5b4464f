"""fp8 Linear: e4m3 forward, e5m2 gradients, per-tensor current scaling (amax of the tensor).

Three backends compute the same thing:
- ``emulated``: quantise–dequantise through ``torch.float8_e4m3fn`` and multiply in fp32
  (fp8 GEMMs accumulate in fp32 too). Runs anywhere; for accuracy, not speed.
- ``torch``: ``torch._scaled_mm`` (CUDA SM >= 8.9). It has no backward, wants K and N
  multiples of 16 and the second operand column-major, so it sits in an autograd.Function
  whose backward runs dgrad and wgrad as ``_scaled_mm`` too (e5m2 x e4m3).
- ``te``: Transformer Engine's ``te.Linear`` sharing the module's weights (lazy import),
  current scaling (``Float8CurrentScaling``); ``te-delayed``: the same with TE's delayed
  scaling (``DelayedScaling``: scales from an amax history of past steps; torchao 0.18 has
  no delayed scaling). fprop, dgrad and wgrad in fp8 either way.
- ``torchao`` / ``torchao-rowwise``: torchao's float8 training (``lower.torchao_fp8``):
  fprop, dgrad and wgrad in fp8 through the library (the train form's backend).

The quantisation (per-tensor current scaling: scale = fmax / amax) is the format's own:
``autoprec.formats.fp8``.
"""

from __future__ import annotations

from typing import Any

import torch

from autoprec.formats.fp8 import (
    E4M3,
    E5M2,
    dequantize_fp8,
    fake_quant_fp8,
    quantize_fp8,
    row_chunks,
)
from autoprec.formats.gemm import linear_dims, linear_weight, stores_in_out
from autoprec.lower import nvfp4_train, torchao_fp8
from autoprec.lower.autocast import compute_dtype
from autoprec.lower.weight_cache import weight_cache_allowed


def _scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) fp8 @ (N, K)^T fp8 -> (M, N) via torch._scaled_mm, padding M to 16."""
    m = xq.shape[0]
    pad = (-m) % 16
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
    # _scaled_mm takes the inverse scales (dequantisation factors); w.t() is column-major.
    y = torch._scaled_mm(
        xq, wq.t(), scale_a=(1.0 / sx).reshape(()), scale_b=(1.0 / sw).reshape(()),
        bias=bias, out_dtype=out_dtype,
    )
    return y[:m] if pad else y


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


def _scaled_backward(gq: torch.Tensor, sg: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor,
                     wq: torch.Tensor, sw: torch.Tensor, in_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """dgrad and wgrad as fp8 GEMMs (torch._scaled_mm, fp32 accumulate): dX (M, K) =
    e5m2 dY (M, N) x e4m3 W (N, K); dW (N, K) = e5m2 dY^T (N, M) x e4m3 X (M, K), fp32.

    _scaled_mm wants the first operand row-major, the second column-major, and the inner
    dim a multiple of 16: wgrad's inner dim is the token count M, padded with zero rows
    (they add nothing to the sums)."""
    m = gq.shape[0]
    pad = (-m) % 16
    gp, xp = _pad_rows(gq, pad), _pad_rows(xq, pad)  # (M', N), (M', K)
    inv_g, inv_w, inv_x = ((1.0 / s).reshape(()) for s in (sg, sw, sx))
    grad_x = torch._scaled_mm(gp, wq.t().contiguous().t(), scale_a=inv_g, scale_b=inv_w,
                              out_dtype=in_dtype)[:m]
    grad_w = torch._scaled_mm(gp.t().contiguous(), xp.t().contiguous().t(), scale_a=inv_g,
                              scale_b=inv_x, out_dtype=torch.float32)
    return grad_x, grad_w


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T (+ b) with e4m3 operands; backward quantises dY to e5m2."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                backend: str, out_dtype: torch.dtype,
                wq_sw: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K), M = tokens
        xq, sx = quantize_fp8(x2, E4M3)
        wq, sw = wq_sw  # (N, K) e4m3 and its scale, cast once per weight version
        if backend == "torch":
            # straight to the region's dtype (an fp16 region was rounded through bf16 before),
            # the bias in the GEMM's epilogue where the output is 16-bit
            fused = bias is not None and out_dtype != torch.float32
            y = _scaled_mm(xq, sx, wq, sw, out_dtype, bias.to(out_dtype) if fused else None)
            if bias is not None and not fused:
                y = y + bias
        else:
            # fp32 accumulate, like the GEMM; a large weight read back in pieces of its
            # output features (the same sums: each output's dot product is whole)
            xd = dequantize_fp8(xq, sx)
            pieces = row_chunks(wq)
            if len(pieces) == 1:
                y = xd @ dequantize_fp8(wq, sw).t()
            else:
                y = torch.cat([xd @ dequantize_fp8(wq[r], sw).t() for r in pieces], dim=-1)
            if bias is not None:
                y = y + bias.float()
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.backend = backend
        ctx.has_bias = bias is not None
        ctx.in_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        return y.to(out_dtype).reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        xq, sx, wq, sw = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        gq, sg = quantize_fp8(g2, E5M2)
        if ctx.backend == "torch":  # fp8 tensor cores for dgrad and wgrad too
            grad_x, grad_w = _scaled_backward(gq, sg, xq, sx, wq, sw, ctx.in_dtype)
            grad_w = grad_w.to(ctx.w_dtype)
        else:
            g = dequantize_fp8(gq, sg)
            grad_x = (g @ dequantize_fp8(wq, sw)).to(ctx.in_dtype)  # (M, K)
            grad_w = (g.t() @ dequantize_fp8(xq, sx)).to(ctx.w_dtype)  # (N, K)
        grad_b = g2.float().sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return grad_x.reshape(*grad_out.shape[:-1], -1), grad_w, grad_b, None, None, None


def fp8_linear(module: torch.nn.Module, x: torch.Tensor, backend: str = "emulated") -> torch.Tensor:
    """Run a Linear-like ``module`` on ``x`` in fp8 with the given backend."""
    if backend in ("te", "te-delayed"):
        return _te_linear(module, x, delayed=backend == "te-delayed")
    if backend in torchao_fp8.RECIPES:
        return torchao_fp8.torchao_linear(module, x, torchao_fp8.RECIPES[backend])
    weight = linear_weight(module)
    bias = getattr(module, "bias", None)
    out_dtype = compute_dtype(x)
    # Autocast must not re-cast inside our arithmetic: the fp8 math is explicit.
    with torch.autocast(x.device.type, enabled=False):
        return _Fp8LinearFn.apply(x, weight, bias, backend, out_dtype,
                                  _weight_fp8(module, weight))


#: The attributes ``_weight_fp8`` and ``blockscale._weight_cache`` keep a module's
#: quantised weight in (one more copy of the weight, in 8 or 4 bits, with its scales), and
#: the one the torchao backend keeps its library module in, and nvfp4 training's 16x16 weight
#: (``nvfp4_train.WEIGHT_ATTR``).
WEIGHT_CACHES = ("_autoprec_fp8_weight", "_autoprec_block_weight", torchao_fp8.CACHE_ATTR,
                 nvfp4_train.WEIGHT_ATTR)


def drop_weight_caches(model: torch.nn.Module) -> int:
    """Forget every quantised-weight cache on ``model`` and its children (a plan removed,
    a probe's shadow done): the copies go with it. Returns how many were dropped."""
    n = 0
    for m in model.modules():
        for attr in WEIGHT_CACHES:
            if m.__dict__.pop(attr, None) is not None:
                n += 1
    return n


def _weight_fp8(module: torch.nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight in e4m3 with its scale, cached on the module until the weight changes.

    Inference casts the weight once (as Transformer Engine does); in training every
    optimizer step bumps the tensor's version and the next call re-quantises it.
    """
    if torch.compiler.is_compiling() or not weight_cache_allowed():
        # compiling: data_ptr() would break the graph (compiled code fuses the cast into
        # it); torch.distributed: FSDP2 rewrites weights in place (lower.weight_cache)
        with torch.no_grad():
            return quantize_fp8(weight.detach(), E4M3)
    key = (weight.data_ptr(), weight._version, weight.device, tuple(weight.shape))
    cached = module.__dict__.get("_autoprec_fp8_weight")
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        wq_sw = quantize_fp8(weight.detach(), E4M3)
    module.__dict__["_autoprec_fp8_weight"] = (key, wq_sw)
    return wq_sw


def _te_linear(module: torch.nn.Module, x: torch.Tensor, delayed: bool = False) -> torch.Tensor:
    """Transformer Engine path: a te.Linear sharing this module's weight and bias; current
    scaling, or ``delayed`` scaling (TE's ``DelayedScaling`` recipe)."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except ImportError as err:  # capability() said te was available; keep the hint anyway
        raise ImportError("fp8 backend 'te' needs transformer_engine: "
                          "pip install 'autoprec[fp8]'") from err
    te_mod = getattr(module, "_autoprec_te", None)
    if te_mod is None:
        k, n = linear_dims(module) or (0, 0)
        te_mod = te.Linear(k, n, bias=module.bias is not None, params_dtype=torch.float32,
                           device=module.weight.device)
        # Share, never copy: the fp32 master weights stay the module's own parameters.
        te_mod.weight = None if stores_in_out(module) else module.weight
        if te_mod.weight is None:
            raise ValueError("te fp8 backend does not support HF Conv1D; use 'torch'")
        if module.bias is not None:
            te_mod.bias = module.bias
        object.__setattr__(module, "_autoprec_te", te_mod)
    # TE wants the token count divisible by 8 (lead from TE docs): pad the flattened rows.
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    pad = (-x2.shape[0]) % 16
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    fp8_recipe = recipe.DelayedScaling() if delayed else recipe.Float8CurrentScaling()
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        y = te_mod(x2)
    if pad:
        y = y[: x2.shape[0] - pad]
    return y.reshape(*shape[:-1], y.shape[-1])


def reference_fp8_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Hand reference for tests: explicit casts, no autograd.Function."""
    y = fake_quant_fp8(x.reshape(-1, x.shape[-1])) @ fake_quant_fp8(weight).t()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], -1)


__all__ = ["fp8_linear", "reference_fp8_linear"]
