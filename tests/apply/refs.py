"""Hand references for apply tests: each layer computed with explicit casts, no autocast.

``ref_linear(x, lin, p)`` is what a Linear computes at precision ``p``:
- fp32: the fp32 GEMM on fp32 operands (16-bit inputs upcast, as a fp32 island does);
- tf32: operands rounded to tf32's 10-bit mantissa (what the tensor core reads), bias
  added in fp32;
- bf16/fp16: operands and bias cast to the 16-bit dtype, output in that dtype (autocast's
  ``addmm``; on GPU tensor cores accumulate in fp32 and round once, as CPU does here);
- fp8: e4m3 operands with per-tensor current scaling, fp32 accumulate; the backward
  quantises dY to e5m2 (``Fp8Ref``), written from the recipe, not from fp8.py's Function;
- mxfp8 / nvfp4: the block-scaled operands, fp32 accumulate (forward only); nvfp4 as the
  train form (these tests' form) runs it: NVIDIA's recipe, the weight in 16x16 tiles.

Every rounding comes from ``tests/reference_formats.py`` (the format definitions), never
from autoprec's own quantisers: a bug there would otherwise be in the reference too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.formats.precisions import dtype_tols
from tests import reference_formats as ref

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Fp8Ref(torch.autograd.Function):
    """y = q(x) q(W)^T + b with e4m3 q(); dX = q5(dY) q(W), dW = q5(dY)^T q(x)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        x2 = x.float().reshape(-1, x.shape[-1])  # (M, K)
        xq, wq = ref.fp8_current_scaling(x2), ref.fp8_current_scaling(w)  # (M, K), (N, K)
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = b is not None
        y = xq @ wq.t()
        if b is not None:
            y = y + b.float()
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        g = ref.fp8_current_scaling(gy.reshape(-1, gy.shape[-1]), ref.E5M2)  # (M, N)
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
        xf = x.float()
        return F.linear(ref.ste(xf, ref.round_tf32(xf)), ref.ste(w, ref.round_tf32(w)), b)
    if p in DTYPES:
        d = DTYPES[p]
        return F.linear(x.to(d), w.to(d), None if b is None else b.to(d))
    if p == "fp8":
        y = Fp8Ref.apply(x, w, b)
        return y if out_dtype is None else y.to(out_dtype)
    if p in ("mxfp8", "nvfp4"):  # forward only
        q = ref.mxfp8 if p == "mxfp8" else ref.nvfp4
        qw = ref.mxfp8 if p == "mxfp8" else ref.nvfp4_2d
        y = q(x.float().reshape(-1, x.shape[-1])) @ qw(w).t()  # (M, N), fp32 accumulate
        y = (y if b is None else y + b.float()).reshape(*x.shape[:-1], -1)
        return y if out_dtype is None else y.to(out_dtype)
    raise ValueError(p)


#: How close an applied layer and its hand reference must be: fp32's tolerance, whatever
#: the layer's precision. The reference rounds the same operands at the same precision and
#: accumulates in fp32 as the layer does (on a CPU both run one kernel: they agree bit for
#: bit), so all that may differ is the fp32 accumulation order. A layer run one precision
#: off moves its output by that precision's rounding, far past it: tf32 <-> fp32 by
#: ~2**-11 relative, bf16 <-> fp16 by ~2**-9, fp8 or nvfp4 <-> anything by 2**-4 or more.
SAME = dtype_tols("fp32")


def assert_same_numerics(got: torch.Tensor, want: torch.Tensor, what: str = "output") -> None:
    """``got`` is what the hand reference ``want`` computed: the same dtype, values at
    :data:`SAME`. Raises AssertionError naming ``what``."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, the reference's {want.dtype}"
    torch.testing.assert_close(got.float(), want.float(), **SAME,
                               msg=lambda m: f"{what}: {m}")


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Gradients of <out, g> for a fixed random g (a full backward, not just sum())."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad((out.float() * g).sum(), inputs, allow_unused=True))


def rel_l2(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.float() - want.float()).norm() / want.float().norm())
