"""Hand references for apply tests: each layer computed with explicit casts, no autocast.

``ref_linear(x, lin, p)`` is what a Linear computes at precision ``p``:
- fp32: the fp32 GEMM on fp32 operands (16-bit inputs upcast, as a fp32 island does);
- tf32: operands rounded to tf32's 10-bit mantissa (what the tensor core reads), bias
  added in fp32;
- bf16/fp16: operands and bias cast to the 16-bit dtype, output in that dtype (autocast's
  ``addmm``; on GPU tensor cores accumulate in fp32 and round once, as CPU does here);
- fp8: e4m3 operands with per-tensor current scaling, fp32 accumulate; the backward
  quantises dY to e5m2 (``Fp8Ref``), written from the recipe, not from fp8.py's Function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.formats.fp8 import E5M2, fake_quant_fp8
from autoprec.lower.forward import round_to_tf32

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Fp8Ref(torch.autograd.Function):
    """y = q(x) q(W)^T + b with e4m3 q(); dX = q5(dY) q(W), dW = q5(dY)^T q(x)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        x2 = x.float().reshape(-1, x.shape[-1])  # (M, K)
        xq, wq = fake_quant_fp8(x2), fake_quant_fp8(w.float())  # (M, K), (N, K)
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = b is not None
        y = xq @ wq.t()
        if b is not None:
            y = y + b.float()
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        g = fake_quant_fp8(gy.reshape(-1, gy.shape[-1]).float(), E5M2)  # (M, N)
        gx = (g @ wq).reshape(*gy.shape[:-1], -1)
        gw = g.t() @ xq
        gb = gy.reshape(-1, gy.shape[-1]).float().sum(0) if ctx.has_bias else None
        return gx, gw, gb


def ref_linear(x: torch.Tensor, lin: nn.Linear, p: str, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """``lin(x)`` at precision ``p`` by hand. ``out_dtype``: fp8's output dtype (the
    surrounding autocast dtype, else fp32)."""
    w, b = lin.weight, lin.bias
    if p == "fp32":
        return F.linear(x.float(), w, b)
    if p == "tf32":
        return F.linear(round_to_tf32(x.float()), round_to_tf32(w), b)
    if p in DTYPES:
        d = DTYPES[p]
        return F.linear(x.to(d), w.to(d), None if b is None else b.to(d))
    if p == "fp8":
        y = Fp8Ref.apply(x, w, b)
        return y if out_dtype is None else y.to(out_dtype)
    if p in ("mxfp8", "nvfp4"):  # forward only (the backends' own hand reference)
        from autoprec.lower.blockscale import reference_blockscaled_linear

        y = reference_blockscaled_linear(x.float(), w, b, p)
        return y if out_dtype is None else y.to(out_dtype)
    raise ValueError(p)


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Gradients of <out, g> for a fixed random g (a full backward, not just sum())."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad((out.float() * g).sum(), inputs, allow_unused=True))


def rel_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())
