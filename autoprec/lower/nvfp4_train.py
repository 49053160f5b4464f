"""NVFP4 training: NVIDIA's recipe for a Linear-like layer's three GEMMs, over fp32 masters.

``nvfp4_train_linear(module, x, backend)`` computes ``y = x W^T + b`` as NVIDIA's NVFP4
pre-training recipe does (arXiv 2509.25149; Transformer Engine's ``NVFP4BlockScaling``;
torchao's ``NVFP4TrainingConfig``), each GEMM quantised along its own reduction dim and
accumulated in fp32 (the quantisers: ``autoprec.formats.nvfp4_train``):

    fprop  Y  (M, N) = q1(X)  q2(W)^T              X 1x16 along K, RNE; W 16x16 tiles, RNE
    dgrad  dX (M, K) = qs(dY) q2(W)                 dY 1x16 along N, stochastic rounding;
                                                    W the same tiles (W^T = the same values)
    wgrad  dW (N, K) = qs(R^T dY)^T q1(R^T X)      both 1x16 along the tokens M after the
                                                    random Hadamard transform R (16x16)

The bias gradient is the fp32 sum of dY. The parameters stay fp32 masters: the weight's
16x16 quantisation is cached per weight version (re-quantised after each optimizer step).

Backends: ``train-emulated`` (quantise-dequantise, fp32 matmuls: anywhere, for accuracy)
and ``train-torch`` (the same quantised operands through ``torch.nn.functional.scaled_mm``'s
NVFP4 GEMM, ``blockscale.scaled_mm_call``: CUDA SM >= 10.0, ``blockscale_capability``).
The token dim M is zero-padded to a multiple of 32 (zero rows leave every block scale and
the per-tensor amax unchanged; the packed fp4 wgrad reduction needs M / 2 a multiple of 16).

Stochastic rounding draws from a ``torch.Generator`` kept on the module, seeded with
``SR_SEED`` at first use: the same initial weights and batches give the same training run,
and the model's own random stream (dropout) is not consumed.
"""

from __future__ import annotations

from typing import Any

import torch

from autoprec.device.capability import blockscale_capability
from autoprec.errors import CapabilityError
from autoprec.formats.gemm import linear_weight
from autoprec.formats.nvfp4 import NVFP4Tensor, dequantize_nvfp4
from autoprec.formats.nvfp4_train import (
    fake_quant_nvfp4_1d,
    fake_quant_nvfp4_2d,
    quantize_nvfp4_1d,
    quantize_nvfp4_2d,
    rht,
    rht_matrix,
    rht_signs,
    transpose_2d,
)
from autoprec.lower.autocast import compute_dtype
from autoprec.lower.blockscale import scaled_mm_call
from autoprec.lower.weight_cache import weight_cache_allowed

#: The backends of the NVFP4 training recipe -> the block-scaled backend its GEMMs run on.
TRAIN_BACKENDS: dict[str, str] = {"train-emulated": "emulated", "train-torch": "torch"}
#: Seed of each module's stochastic-rounding generator.
SR_SEED = 0
#: Module attributes: the cached 16x16-quantised weight, the rounding generator.
WEIGHT_ATTR = "_autoprec_nvfp4_train_weight"
RNG_ATTR = "_autoprec_nvfp4_rng"
_ROWS = 32  # the token dim's padding (see the module docstring)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[0]) % _ROWS
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


def _q(t: torch.Tensor, backend: str, stochastic: bool = False,
       generator: torch.Generator | None = None) -> Any:
    """``t`` (R, C) in 1x16 blocks along C: fp32 values (emulated) or an NVFP4Tensor (torch)."""
    if backend == "torch":
        return quantize_nvfp4_1d(t, stochastic=stochastic, generator=generator)
    return fake_quant_nvfp4_1d(t, stochastic=stochastic, generator=generator)


def _mm(a: Any, b: Any, backend: str) -> torch.Tensor:
    """a (R, C) @ b (S, C)^T -> (R, S) fp32, both quantised along C (``_q``'s forms)."""
    if backend == "torch":
        args, kwargs = scaled_mm_call(a, b, "nvfp4", torch.float32)
        return torch.nn.functional.scaled_mm(*args, **kwargs)
    return a @ b.t()


class _NVFP4TrainFn(torch.autograd.Function):
    """The three GEMMs of the NVFP4 recipe (module docstring); fp32 in the GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                backend: str, out_dtype: torch.dtype, wq: NVFP4Tensor,
                gen: torch.Generator) -> torch.Tensor:
        shape = x.shape
        m = x.numel() // shape[-1]
        x2 = _pad_rows(x.reshape(m, shape[-1]).float())  # (M', K)
        w = wq  # (N, K), 16x16 tiles: quantised (torch) or its fp32 values (emulated)
        y = _mm(_q(x2, backend), w, backend)[:m]  # (M, N)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2)
        ctx.wq, ctx.gen, ctx.backend, ctx.m = wq, gen, backend, m
        ctx.has_bias = bias is not None
        ctx.in_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y.to(out_dtype).reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        (x2,) = ctx.saved_tensors  # (M', K)
        m, gen, backend = ctx.m, ctx.gen, ctx.backend
        g = _pad_rows(grad_out.reshape(m, grad_out.shape[-1]).float())  # (M', N)
        # dgrad: dY along N (stochastic) x W^T along N: the same 16x16 tiles, transposed
        wt = transpose_2d(ctx.wq) if backend == "torch" else ctx.wq.t()
        grad_x = _mm(_q(g, backend, True, gen), wt, backend)[:m]  # (M, K)
        # wgrad: both operands along the tokens, after the Hadamard transform
        r = rht_matrix(rht_signs(device=g.device))
        gt = _q(rht(g, r).t().contiguous(), backend, True, gen)  # (N, M')
        xt = _q(rht(x2, r).t().contiguous(), backend)  # (K, M'), round to nearest
        grad_w = _mm(gt, xt, backend)  # (N, K)
        grad_b = g[:m].sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return (grad_x.to(ctx.in_dtype).reshape(*grad_out.shape[:-1], -1),
                grad_w.to(ctx.w_dtype), grad_b, None, None, None, None)


def _weight_2d(module: torch.nn.Module, weight: torch.Tensor, backend: str) -> Any:
    """The weight in 16x16 tiles, cached on the module until the weight changes (not under
    ``torch.distributed``: FSDP2 rewrites weights in place, ``lower.weight_cache``):
    quantised for the torch backend, its fp32 values for the emulated one (no 4-bit codes
    written and read back at every forward of a streamed block)."""
    quantize = quantize_nvfp4_2d if backend == "torch" else fake_quant_nvfp4_2d
    if torch.compiler.is_compiling() or not weight_cache_allowed():
        with torch.no_grad():
            return quantize(weight.detach())
    key = (weight.data_ptr(), weight._version, weight.device, tuple(weight.shape), backend)
    cached = module.__dict__.get(WEIGHT_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        value = quantize(weight.detach())
    module.__dict__[WEIGHT_ATTR] = (key, value)
    return value


def _generator(module: torch.nn.Module, device: torch.device) -> torch.Generator:
    gen = module.__dict__.get(RNG_ATTR)
    if gen is None or gen.device != device:
        gen = torch.Generator(device=device).manual_seed(SR_SEED)
        module.__dict__[RNG_ATTR] = gen
    return gen


def nvfp4_train_linear(module: torch.nn.Module, x: torch.Tensor,
                       backend: str = "train-emulated") -> torch.Tensor:
    """Run a Linear-like ``module`` on ``x`` (..., K) under the NVFP4 training recipe.

    ``backend``: a key of ``TRAIN_BACKENDS``. The output is in the input's dtype (or the
    autocast dtype when one is active), as ``blockscale.blockscaled_linear``'s. Raises
    ``BlockShapeError`` (a ValueError) unless both weight dims are multiples of 16,
    ``CapabilityError`` when ``backend`` cannot run here (with the reason).
    """
    if backend not in TRAIN_BACKENDS:
        raise ValueError(f"unknown nvfp4 training backend {backend!r}; expected one of "
                         f"{', '.join(TRAIN_BACKENDS)}")
    if backend != "train-emulated":
        ok, why = blockscale_capability("nvfp4", backend, x.device)
        if not ok:
            raise CapabilityError(why)
    weight = linear_weight(module)
    out_dtype = compute_dtype(x)
    wq = _weight_2d(module, weight, TRAIN_BACKENDS[backend])
    with torch.autocast(x.device.type, enabled=False):
        return _NVFP4TrainFn.apply(x, weight, getattr(module, "bias", None),
                                   TRAIN_BACKENDS[backend], out_dtype, wq,
                                   _generator(module, x.device))


def reference_nvfp4_train_grads(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                                generator: torch.Generator | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hand reference for tests: (y, dX, dW) of the recipe for x (M, K), W (N, K), dY (M, N),
    written as explicit fake-quantised matmuls (M a multiple of 32: no padding, so the
    stochastic rounding draws the same uniforms as the layer's)."""
    wq = dequantize_nvfp4(quantize_nvfp4_2d(weight))  # (N, K)
    y = fake_quant_nvfp4_1d(x) @ wq.t()
    dx = fake_quant_nvfp4_1d(grad_out, stochastic=True, generator=generator) @ wq
    r = rht_matrix(rht_signs())
    dw = fake_quant_nvfp4_1d(rht(grad_out, r).t(), stochastic=True, generator=generator) @ \
        fake_quant_nvfp4_1d(rht(x, r).t()).t()
    return y, dx, dw


__all__ = ["RNG_ATTR", "SR_SEED", "TRAIN_BACKENDS", "WEIGHT_ATTR", "nvfp4_train_linear",
           "reference_nvfp4_train_grads"]
