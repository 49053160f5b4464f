"""How one module is lowered to a precision. Shared by apply (policies) and probe.

A *region* is the numeric context a module's forward runs in:
- fp32: autocast disabled, 16-bit floating inputs upcast (a fp32 island next to a fp16
  neighbour would otherwise fail: "mat1 and mat2 must have the same dtype").
- tf32: fp32 plus tf32 matmuls — on Ampere+ via ``torch.backends.cuda.matmul``; elsewhere
  emulated by rounding matmul/conv operands to 10 mantissa bits (what the tensor core
  reads).
- bf16 / fp16: ``torch.autocast(dtype=…)``. The weight-cast cache is keyed on the weight,
  so a weight used in two low dtypes in one outer region (tied weights, a module called
  twice) would get the first cast: the cache is on only under ``no_grad`` where a plan's
  regions have one 16-bit dtype (``cast_cache``), as one global autocast runs.
- fp8 / mxfp8 / nvfp4: not regions; Linear-like leaves call their GEMM backend
  (``backends.linear``: fp8.py, blockscale.py).

``emulate_cuda``: on a CPU, autocast regions also run the ops CUDA autocast keeps in fp32
(layer_norm, softmax, sum, exp, ...) in fp32 (``lower.autocast.TargetFp32Ops``), so that
accuracy measured here is that of a CUDA deployment; fp32/tf32 islands suspend it.

The forward is wrapped in a ``with`` block (not pre-/post-hooks): hooks that enter and
leave autocast break torch.compile and leave the region open when forward raises.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from autoprec.errors import CapabilityError, PolicyError
from autoprec.formats.fp8 import CHUNK
from autoprec.formats.gemm import ineligible_reason
from autoprec.formats.precisions import AUTOCAST_DTYPES, check_precision, is_gemm_format
from autoprec.lower import backends, torchao_fp8
from autoprec.lower.autocast import suspend_target_fp32_ops, target_fp32_ops

_LOW_FLOATS = (torch.float16, torch.bfloat16)


def cast_floats(obj: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] = _LOW_FLOATS) -> Any:
    """Cast floating tensors (of dtypes in ``only``) inside args to ``dtype``; keep the rest."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype in only else obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(cast_floats(v, dtype, only) for v in obj)
    if isinstance(obj, list):
        return [cast_floats(v, dtype, only) for v in obj]
    if type(obj) is dict:
        return {k: cast_floats(v, dtype, only) for k, v in obj.items()}
    return obj


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to tf32's 10-bit mantissa (round to nearest even); inf/nan kept.

    On the int32 view: add 0xFFF plus the lowest kept bit, clear the 13 dropped bits (an
    inf has no dropped bits set: it stays inf; a finite value past tf32's largest rounds to
    inf, as RNE does). Only a NaN can go wrong (a payload in the dropped bits rounds to inf
    or wraps to 0), so NaNs are put back — looked for with one sum, which is NaN exactly
    when a NaN is present or +inf meets -inf. On a CPU the integer passes run in numpy on
    one buffer (torch allocates, and the OS zero-fills, a fresh tensor per pass: ~3x slower
    on a 16 M-element activation).

    Differentiable as a straight-through estimator: the value is rounded, the gradient
    passes unchanged (the rounding's bit view has no gradient, which zeroed every
    gradient of a tf32 layer). The backward GEMMs then read the saved rounded operands.
    """
    if x.dtype != torch.float32 or _tf32_already(x):
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThroughTF32.apply(x)
    return _rounded_tf32(x)


def _tf32_already(x: torch.Tensor) -> bool:
    """Whether every value of a CPU fp32 tensor has its 13 dropped bits clear (a weight
    widened from bf16: fp32 masters loaded from a bf16 checkpoint), so rounding is the
    identity; read a piece at a time, stopping at the first piece that is not. Other
    tensors (and compiled code) are rounded without looking."""
    plain = x.detach()  # a Parameter's data is a plain tensor
    if x.device.type != "cpu" or type(plain) is not torch.Tensor \
            or torch.compiler.is_compiling() or not x.is_contiguous() or x.numel() < _CHECK_FROM:
        return False
    bits = plain.reshape(-1).numpy().view(np.int32)
    if np.bitwise_and(bits[:4096], 0x1FFF).any():  # an activation: told by its first values
        return False
    return not any(np.bitwise_and(bits[i:i + CHUNK], 0x1FFF).any()
                   for i in range(0, bits.size, CHUNK))


#: tensors smaller than this are rounded without the check (it would cost more than the copy)
_CHECK_FROM = 1 << 20


class _StraightThroughTF32(torch.autograd.Function):
    """The rounded value forward, the gradient passed unchanged backward: no copy of ``x``
    beyond the rounded one (``x + (rounded - x)``, the same value, took four whole-size
    temporaries: ~9 GB on an 8 B Llama's fp32 LM head)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _rounded_tf32(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _rounded_tf32(x: torch.Tensor) -> torch.Tensor:
    """``round_to_tf32``'s value, without gradient."""
    with torch.no_grad():
        src = x.detach().contiguous()
        if src.device.type == "cpu" and type(src) is torch.Tensor \
                and not torch.compiler.is_compiling():
            f = src.numpy()
            bits = f.view(np.int32)
            r = bits >> 13  # (the only new buffer)
            r &= 1
            r += bits
            r += 0x0FFF
            r &= ~0x1FFF
            out = r.view(np.float32)
            with np.errstate(all="ignore"):  # overflow / inf - inf: only a flag here
                suspect = bool(f.size) and np.isnan(f.sum())
            if suspect:
                nan = np.isnan(f)
                out[nan] = f[nan]
            rounded = torch.from_numpy(out)
        else:
            bits = src.view(torch.int32)
            r = (bits >> 13) & 1
            r += bits
            r += 0x0FFF
            r &= ~0x1FFF
            rounded = torch.where(torch.isnan(src), src, r.view(torch.float32))
    return rounded


# Ops whose floating operands a tf32 tensor core would read at 10 mantissa bits.
_TF32_OPS: set[Callable[..., Any]] = {
    torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
    torch.nn.functional.linear, torch.nn.functional.bilinear,
    torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d,
    torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
    torch.nn.functional.conv_transpose3d,
    torch.nn.functional.scaled_dot_product_attention,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.Tensor.mm, torch.Tensor.bmm,
}


_ADD_FIRST = {torch.addmm, torch.baddbmm}
_BIAS_THIRD = {
    torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
    torch.nn.functional.conv3d, torch.nn.functional.conv_transpose1d,
    torch.nn.functional.conv_transpose2d, torch.nn.functional.conv_transpose3d,
}


#: F.multi_head_attention_forward is a Python function with its own torch-function check:
#: a mode handling it runs its insides with the mode popped, so its projections would not
#: be rounded. Its GEMM operands are rounded on the way in instead: query/key/value and the
#: projection weights (positions 0-2, 5, 11; the separate q/k/v weights by keyword). Not
#: rounded: SDPA's own matmuls and the out-projection's activation operand (README, Limits).
_MHA = torch.nn.functional.multi_head_attention_forward
_MHA_OPERANDS = (0, 1, 2, 5, 11)
_MHA_WEIGHT_KWARGS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _mha_operands(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Round MHA's GEMM operands, keeping ``query is key is value`` (its packed path)."""
    done: dict[int, torch.Tensor] = {}
    out = []
    for i, a in enumerate(args):
        if i in _MHA_OPERANDS and isinstance(a, torch.Tensor):
            a = done.setdefault(id(a), round_to_tf32(a))
        out.append(a)
    return tuple(out)


#: Tf32Emulation modes currently entered (innermost last). A fp32/bf16/fp16 region nested
#: inside a tf32 one suspends them: the function-mode stack is not scoped by autocast, so
#: without this a fp32 island inside a tf32 container was still rounded to tf32.
_TF32_MODES: list[Tf32Emulation] = []


class Tf32Emulation(TorchFunctionMode):
    """Rounds matmul/conv operands to tf32 while active (devices without tf32 cores)."""

    def __init__(self) -> None:
        super().__init__()
        self.suspended = 0

    def __enter__(self) -> Tf32Emulation:
        _TF32_MODES.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _TF32_MODES.remove(self)
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is _MHA and not self.suspended:
            return func(*_mha_operands(args), **{
                k: round_to_tf32(v) if k in _MHA_WEIGHT_KWARGS and v is not None else v
                for k, v in kwargs.items()})
        if func in _TF32_OPS and not self.suspended:
            # Only the multiplied operands are read at tf32; a bias (linear/conv's third
            # argument, addmm's first) is added in the fp32 epilogue.
            skip = 0 if func in _ADD_FIRST else 2 if func in _BIAS_THIRD else None
            args = tuple(a if i == skip else _map_tensors(a, round_to_tf32)
                         for i, a in enumerate(args))
            keep = "input" if func in _ADD_FIRST else "bias"
            kwargs = {k: v if k == keep else _map_tensors(v, round_to_tf32)
                      for k, v in kwargs.items()}
        return func(*args, **kwargs)


def tf32_emulation_active() -> bool:
    """True while matmul operands are being rounded to tf32 (the audit reads this)."""
    return any(not m.suspended for m in _TF32_MODES)


@contextlib.contextmanager
def _suspend_tf32() -> Iterator[None]:
    modes = list(_TF32_MODES)
    for m in modes:
        m.suspended += 1
    try:
        yield
    finally:
        for m in modes:
            m.suspended -= 1


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def _cuda_tf32(enabled: bool) -> Iterator[None]:
    if torch.compiler.is_compiling() and torch.backends.cuda.matmul.allow_tf32 != enabled:
        # A flag flip inside a compiled graph is not traced: the graph's aten.mm runs with
        # whatever the global flag says (seen: a tf32 region compiled to plain fp32).
        raise CapabilityError(
            f"a {'tf32' if enabled else 'fp32'} region needs torch.backends.cuda.matmul."
            f"allow_tf32={enabled} inside a torch.compile graph, which does not hold there; "
            "set the flag globally to match, or use a policy without tf32 regions under "
            "torch.compile")
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def region(precision: str, device_type: str, emulate_cuda: bool = False,
           cast_cache: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The numeric context for ``precision`` (fp32/tf32/bf16/fp16) on ``device_type``.
    ``cast_cache``: autocast's weight-cast cache on (see ``lowered_forward``)."""
    check_precision(precision)
    if is_gemm_format(precision):
        raise ValueError(f"{precision} is a module backend, not an autocast region")
    if precision in AUTOCAST_DTYPES:
        ctx: contextlib.AbstractContextManager[Any] = torch.autocast(
            device_type, dtype=AUTOCAST_DTYPES[precision], cache_enabled=cast_cache)
    else:
        ctx = torch.autocast(device_type, enabled=False)
    emulate = emulate_cuda and device_type != "cuda"
    # The common case stays one plain autocast object (cheap, and torch.compile traces it
    # without graph breaks); a generator context where tf32 state must change too
    # (dynamo traces @contextmanager, while an ExitStack around autocast graph-breaks).
    if device_type == "cuda" and precision in ("fp32", "tf32"):
        # fp32 keeps full-precision matmuls even if the user enabled tf32 globally.
        return _both(ctx, _cuda_tf32(precision == "tf32"))
    if device_type != "cuda" and precision == "tf32":
        return _both(ctx, Tf32Emulation(), suspend_target_fp32_ops() if emulate else None)
    if emulate:
        inner = target_fp32_ops() if precision in AUTOCAST_DTYPES else suspend_target_fp32_ops()
        return _both(ctx, inner, _suspend_tf32() if _TF32_MODES else None)
    if _TF32_MODES:
        return _both(ctx, _suspend_tf32())
    return ctx


@contextlib.contextmanager
def _both(outer: contextlib.AbstractContextManager[Any],
          inner: contextlib.AbstractContextManager[Any],
          third: contextlib.AbstractContextManager[Any] | None = None) -> Iterator[None]:
    with outer, inner, third if third is not None else contextlib.nullcontext():
        yield


def _device_type(module: torch.nn.Module, args: Any, kwargs: Any) -> str:
    for t in _iter_tensors((args, kwargs)):
        return t.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _iter_tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)


def lowered_forward(
    module: torch.nn.Module,
    precision: str,
    forward: Callable[..., Any] | None = None,
    fp8_backend: str = "emulated",
    on_compute: Callable[[str], None] | None = None,
    emulate_cuda: bool = False,
    cast_cache: bool = False,
) -> Callable[..., Any]:
    """A forward for ``module`` that computes in ``precision``.

    ``forward`` is the function to wrap (default: the module's current forward).
    ``on_compute(precision)`` is called on every call (the audit listens to it).
    ``emulate_cuda``: see the module docstring. ``fp8_backend``: the backend of a GEMM
    format (fp8: emulated/torch/te; mxfp8/nvfp4: emulated/torch).
    ``cast_cache``: under ``no_grad``, autocast's weight-cast cache on, as one global
    ``torch.autocast`` has it; safe only when every autocast region of the forward has one
    dtype (the cache is keyed on the weight alone). It is the fast path there: without it
    a weight cast under ``no_grad`` does not require grad, and aten's matmul then sends a
    non-contiguous 3-D input (MultiheadAttention's batch_first projections) to bmm over
    the weight expanded per batch row instead of one mm: 13x slower for that Linear, 0.67x
    of fp32 for the whole of examples/nn_transformer where the global autocast runs
    1.5x. With grad on, every call casts (a cast that requires grad folds; each call's
    weight gradient is its own cast's, as the hand references in tests/apply compute).
    A GEMM format requires a Linear-like module it is eligible for (ValueError otherwise).
    """
    check_precision(precision)
    inner = forward if forward is not None else module.forward
    if is_gemm_format(precision):
        why = ineligible_reason(module, precision)
        if why is not None:
            raise ValueError(why)
        if precision == "fp8" and fp8_backend in torchao_fp8.RECIPES:
            # the library module built now, eagerly: a compiled forward finds it
            torchao_fp8.prepare(module, torchao_fp8.RECIPES[fp8_backend])

        @functools.wraps(inner)
        def format_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs:  # a Linear-like forward takes one input; never drop arguments
                raise TypeError(f"{precision} {type(module).__name__}.forward takes one input,"
                                f" got {1 + len(args)} positional and {sorted(kwargs)} keyword")
            if on_compute is not None:
                on_compute(precision)
            return backends.linear(module, x, precision, fp8_backend)

        return format_forward

    upcast = precision in ("fp32", "tf32")

    @functools.wraps(inner)
    def region_forward(*args: Any, **kwargs: Any) -> Any:
        if upcast:
            args = cast_floats(args, torch.float32)
            kwargs = cast_floats(kwargs, torch.float32)
        if on_compute is not None:
            on_compute(precision)
        dev = _device_type(module, args, kwargs)
        try:
            with region(precision, dev, emulate_cuda,
                        cast_cache and not torch.is_grad_enabled()):
                return inner(*args, **kwargs)
        except RuntimeError as err:
            if "autocast::prioritize" not in str(err):
                raise
            raise PolicyError(
                f"{type(module).__name__} ({precision} region): autocast on {dev} refuses "
                "bf16 and fp16 tensors meeting in one promote op (cat, stack, index_copy); "
                "give the layers whose outputs meet here the same precision") from err

    return region_forward

