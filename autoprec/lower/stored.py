"""The deploy form of one module: weights stored in its precision, no autocast.

Under the deploy form (``precisions.FORMS``) a plan runs as ``model.to(torch.bfloat16)``
does, region by region: each module's own parameters and floating buffers are stored once
in its region's dtype (``apply.stored`` casts them at apply), activations flow in that
dtype and every op runs in the dtype type promotion gives it — norms, softmax, residual
adds included, as in a 16-bit checkpoint. A tensor keeps the dtype its producer gave it
and is cast only where a consumer needs another (docs/overview.md), which is what keeps a fp32
island's precision alive past its own output (HF's ``_keep_in_fp32_modules`` work so):

- entering a wrapped module (one whose precision differs from its caller's region, and
  the root), floating inputs (fp32/bf16/fp16) are cast to its storage dtype: a bf16
  deployment is fed bf16; nothing is cast on the way out (the root returns what it made);
- a module that holds floating weights (``consumer_kind`` "weights": a Linear, a conv,
  an MHA's own projections) casts its floating inputs to its weights' dtype, since a GEMM
  refuses mixed operands;
- a norm (``consumer_kind`` "norm": LayerNorm, GroupNorm, BatchNorm, RMSNorm) fed another dtype than
  its weights' computes in fp32, as type promotion would: a fp32 input to a bf16 norm (the
  output of a fp32 island) is normalised in fp32 with the norm's small weight vectors
  cast up per call, a 16-bit input to a fp32 norm (or an fp16 one to a bf16 norm) is cast
  up: a signal that survived its layer is not rounded away by the next norm;
- a GEMM-format leaf (fp8 / mxfp8 / nvfp4) reads its input in whatever dtype it arrives,
  quantises it per call, multiplies by the weight quantised once at apply
  (``stored_weight``), and gives its input's dtype.

The plan's replay (``plan.replay_stored.StoredReplay``) applies the same rules, from the
``consumer_kind`` of every module recorded with the trace.

Autocast is off inside every region (a user's own ``torch.autocast`` around a deployed
model changes nothing); a tf32 region rounds matmul operands as the training form's does.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoprec.formats.fp8 import E4M3, quantize_fp8, row_chunks
from autoprec.formats.gemm import is_gemm_module, linear_weight
from autoprec.formats.mx import MXTensor, dequantize_mx, quantize_mx
from autoprec.formats.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    nvfp4_tensor_scale,
    quantize_nvfp4,
)
from autoprec.formats.precisions import STORAGE_DTYPES, is_gemm_format
from autoprec.lower.forward import region

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: Names of the extra tensors a stored GEMM-format weight keeps beside ``weight``.
SCALE, SCALE_2 = "weight_scale", "weight_scale_2"


def cast_tree(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every fp32/bf16/fp16 tensor in it cast to ``dtype`` (tuples, named
    tuples, lists, dicts and HF ModelOutput rebuilt; other members kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype in _FLOATS and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        items = [cast_tree(v, dtype) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)._make(items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [cast_tree(v, dtype) for v in obj]
    if isinstance(obj, Mapping) and hasattr(obj, "__setitem__"):
        # a loop, not a comprehension with ``:=``: dynamo graph-breaks on its cell
        changed: dict[Any, Any] = {}
        for k, v in obj.items():
            c = cast_tree(v, dtype)
            if c is not v:
                changed[k] = c
        if not changed:
            return obj
        out = copy.copy(obj)  # keeps the type (ModelOutput) and non-tensor members
        for k, v in changed.items():
            out[k] = v
        return out
    return obj


def _device_type(args: Any, module: torch.nn.Module) -> str:
    stack = [args]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (tuple, list)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    for t in module.parameters():
        return t.device.type
    return "cpu"


#: Norm modules that compute in fp32 when fed another dtype than their weights'.
NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm) + (
    (torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())


def consumer_kind(module: torch.nn.Module) -> str:
    """How a module reads inputs of another dtype in the deploy form: "norm" (computes in
    the wider dtype), "weights" (its own weights meet its input in a GEMM: casts its inputs
    to them; HF's Conv1D too), "" (its code promotes as PyTorch does: an add or a cat of
    a parameter with an input of another dtype runs in the wider one)."""
    if isinstance(module, NORM_TYPES):
        return "norm"
    # its own weights meet its input in a GEMM (which refuses mixed operands): a GEMM module
    # (``formats.gemm.is_gemm_module``: Linear-likes, Bilinear, convolutions) or an MHA
    if is_gemm_module(module) or isinstance(module, torch.nn.MultiheadAttention):
        return "weights"
    return ""


def _first_float(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype in _FLOATS:
            return a
    return None


def consumer_forward(module: torch.nn.Module, precision: str) -> Callable[..., Any] | None:
    """The input rule of a module that needs no region of its own (module doc), or None
    when it has none (``consumer_kind`` ""). Storage dtype: ``precision``'s."""
    kind = consumer_kind(module)
    if not kind:
        return None
    inner = module.forward
    dtype = STORAGE_DTYPES[precision]

    if kind == "weights":
        @functools.wraps(inner)
        def cast_inputs(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:
                x = args[0]  # the common call, kept cheap: one dtype check
                return inner(x if x.dtype == dtype or x.dtype not in _FLOATS else x.to(dtype))
            return inner(*cast_tree(args, dtype), **cast_tree(kwargs, dtype))

        return cast_inputs

    @functools.wraps(inner)
    def norm_forward(*args: Any, **kwargs: Any) -> Any:
        x = _first_float(args)
        if x is None or x.dtype == dtype:
            return inner(*args, **kwargs)
        if kwargs or len(args) != 1 or (module.training and isinstance(
                module, torch.nn.modules.batchnorm._BatchNorm)):
            return inner(*cast_tree(args, dtype), **cast_tree(kwargs, dtype))
        return _norm_fp32(module, x.float())  # another dtype than its weights': in fp32

    return norm_forward


def _norm_fp32(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a fp32 ``x``, the norm's weight and bias cast up for the call."""
    F = torch.nn.functional

    def up(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float()  # a no-op on fp32 weights

    if isinstance(module, torch.nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, up(module.weight), up(module.bias),
                            module.eps)
    if isinstance(module, torch.nn.GroupNorm):
        return F.group_norm(x, module.num_groups, up(module.weight), up(module.bias),
                            module.eps)
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):  # eval: running stats
        return F.batch_norm(x, up(module.running_mean), up(module.running_var),
                            up(module.weight), up(module.bias), False, 0.0, module.eps)
    return F.rms_norm(x, module.normalized_shape, up(module.weight), module.eps)


def deploy_forward(module: torch.nn.Module, precision: str,
                   backend: str = "emulated",
                   on_compute: Callable[[str], None] | None = None,
                   leaf_region: str | None = None) -> Callable[..., Any]:
    """A forward for a wrapped ``module`` in the deploy form at ``precision`` (see the
    module doc): its floating inputs cast to its storage dtype, autocast off inside.
    ``backend``: a GEMM format's backend; ``leaf_region``: a GEMM-format leaf's region,
    whose storage dtype its output takes (None: its input's)."""
    inner = module.forward
    if is_gemm_format(precision):
        out = None if leaf_region is None else STORAGE_DTYPES[leaf_region]

        @functools.wraps(inner)
        def format_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs:
                raise TypeError(f"{precision} {type(module).__name__}.forward takes one input,"
                                f" got {1 + len(args)} positional and {sorted(kwargs)} keyword")
            if on_compute is not None:
                on_compute(precision)
            return stored_linear(module, x, precision, backend, out)

        return format_forward

    dtype = STORAGE_DTYPES[precision]
    # autocast off in every region; tf32 rounds matmul operands (lower.forward.region)
    ctx_precision = "tf32" if precision == "tf32" else "fp32"

    @functools.wraps(inner)
    def stored_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_tree(args, dtype), cast_tree(kwargs, dtype)
        if on_compute is not None:
            on_compute(precision)
        with region(ctx_precision, _device_type((args, kwargs), module)):
            return inner(*args, **kwargs)

    return stored_forward


# -- GEMM formats: the weight quantised once -------------------------------------------------

def stored_weight(module: torch.nn.Module, fmt: str, backend: str
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(elements, scales)``: the (out, in) weight of a Linear-like ``module`` quantised in
    ``fmt`` as the deploy form stores it — fp8: e4m3 elements and the per-tensor scale;
    mxfp8: e4m3 elements and one E8M0 scale per 32 along K; nvfp4: E2M1 codes (one byte
    each: not packed two to a byte), one E4M3 scale per 16 and the fp32 tensor scale.
    ``backend`` is unused today (both backends read the same stored tensors)."""
    w = linear_weight(module).detach()  # (N, K), as the model holds it
    with torch.no_grad():
        if fmt == "fp8":  # reads w in pieces (an 8 B Llama's LM head whole in fp32: 2.1 GB)
            q, s = quantize_fp8(w, E4M3)
            return q, {SCALE: s.reshape(())}
        # the block formats scale along K within a row: quantised a piece of rows at a time
        rows = row_chunks(w)
        if fmt == "mxfp8":
            from autoprec.lower.blockscale import MX_SCALE_MODE

            ms = [quantize_mx(w[r].float(), scale_mode=MX_SCALE_MODE) for r in rows]
            return torch.cat([m.data for m in ms]), {SCALE: torch.cat([m.scale for m in ms])}
        g = nvfp4_tensor_scale(w)  # one per tensor: before the pieces
        ns = [quantize_nvfp4(w[r].float(), tensor_scale=g) for r in rows]
        return (torch.cat([n.codes for n in ns]),
                {SCALE: torch.cat([n.block_scale for n in ns]), SCALE_2: g.reshape(())})


def _elements(module: torch.nn.Module) -> torch.Tensor:
    """The stored (N, K) elements (HF's Conv1D keeps them as its (K, N) weight)."""
    return linear_weight(module)


def dequantized_weight(module: torch.nn.Module, fmt: str) -> torch.Tensor:
    """The fp32 (N, K) values of a stored quantised weight."""
    q = _elements(module)
    if fmt == "fp8":
        return q.float() / getattr(module, SCALE)
    if fmt == "mxfp8":
        return dequantize_mx(MXTensor(q, getattr(module, SCALE)))
    return dequantize_nvfp4(NVFP4Tensor(q, getattr(module, SCALE), getattr(module, SCALE_2)))


def stored_linear(module: torch.nn.Module, x: torch.Tensor, fmt: str,
                  backend: str = "emulated", out_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """``module(x)`` with its stored quantised weight: the input quantised per call, the
    output in ``out_dtype`` (the region's storage dtype; None: ``x``'s), as the train form's
    GEMM-format leaf gives its region's dtype — a fp32 input (a fp32 island's output) to a
    fp8 leaf of a bf16 region comes out bf16, beside its bf16 siblings (SDPA takes q, k, v
    of one dtype). Inference only (no gradient to a stored weight)."""
    from autoprec.lower import blockscale, fp8

    q = _elements(module)
    bias = getattr(module, "bias", None)
    if out_dtype is None:
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
    with torch.autocast(x.device.type, enabled=False):
        if fmt == "fp8":
            scale = getattr(module, SCALE)
            return fp8._Fp8LinearFn.apply(x, q, bias, backend, out_dtype, (q, scale))
        if fmt == "mxfp8":
            mx = MXTensor(q, getattr(module, SCALE))
            wcache = mx if backend == "torch" else dequantize_mx(mx)
            fn: Any = blockscale._MXFP8LinearFn
        else:
            nv = NVFP4Tensor(q, getattr(module, SCALE), getattr(module, SCALE_2))
            wcache = nv if backend == "torch" else dequantize_nvfp4(nv)
            fn = blockscale._NVFP4LinearFn
        return fn.apply(x, q, bias, backend, out_dtype, wcache)


__all__ = ["NORM_TYPES", "SCALE", "SCALE_2", "cast_tree", "consumer_forward", "consumer_kind",
           "deploy_forward", "dequantized_weight",
           "stored_linear", "stored_weight"]
