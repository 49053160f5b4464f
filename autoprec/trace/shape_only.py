"""A shape-only trace: the ``LayerGraph`` of a model whose weights are on the meta device.

Pricing needs shapes, dtypes and the ops a forward runs, never a weight's value: a
Llama-3-70B built with ``torch.device("meta")`` (or accelerate's ``init_empty_weights``)
holds no memory, and ``trace_shapes`` records its forward as ``trace`` records a real
one, so the cost model prices it at full depth on any profile.

What makes it exact is ``ShadowMode``, a dispatch mode under the tracer's own modes:
every op runs on the meta device (shapes only), and wherever all of an op's tensor inputs
have known values — the batch's token ids, the position ids, masks and ``arange`` built
from them, but nothing computed from a weight — it also runs on a real CPU copy of those
values (the *shadow*). A data-dependent step of the model's code (transformers' packed-
sequence check ``(position_ids[:, -1] == 0).all()``, ``nonzero``, ``.item()``) then reads
its real value and takes the branch the real forward takes. A ``FakeTensorMode`` trace
would not: transformers sees a fake tensor as "tracing" and builds an attention mask the
real forward skips (191 recorded ops against 143 on a 2-layer Llama).

A step whose value depends on a weight cannot be taken on shapes alone: it raises
``ShapeOnlyError`` naming the op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from autoprec.errors import AutoprecError

#: Shadows larger than this many elements are not kept (a (B, 1, T, T) mask at T = 4096 is
#: 16.8 M): past it an op's value is unknown, and only a data-dependent use of it fails.
SHADOW_MAX_NUMEL = 1 << 25

_META = torch.device("meta")
_CPU = torch.device("cpu")
_aten = torch.ops.aten
#: Ops whose output shape or value the meta device cannot give: run on the shadows only.
_VALUE_OPS = frozenset(
    getattr(_aten, name).default for name in (
        "_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "_unique2",
        "unique_consecutive", "unique_dim", "bincount")
    if hasattr(_aten, name))
#: Ops whose CPU kernel writes its first output in the query's layout (``empty_like(q)``)
#: where the meta kernel writes it contiguous: a (B, H, T, D) view of (B, T, H, D) memory,
#: whose ``transpose(1, 2).contiguous()`` is then free, as on the real forward.
_OUTPUT_LIKE_FIRST = frozenset(
    getattr(_aten, name).default for name in ("_scaled_dot_product_flash_attention_for_cpu",)
    if hasattr(_aten, name))


class ShapeOnlyError(AutoprecError):
    """The model's code needs a value that depends on its (absent) weights."""


class ShadowMode(TorchDispatchMode):
    """Runs every op on the meta device, and on real CPU values wherever they are known
    (the module docs). Enter it *outside* the modes that record the forward, so they see
    each op once, on meta tensors."""

    def __init__(self, max_numel: int = SHADOW_MAX_NUMEL) -> None:
        super().__init__()
        self.max_numel = max_numel
        self.shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # meta -> real
        self._metas: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # real -> meta

    # -- values --------------------------------------------------------------------------------
    def _meta_of(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor's meta stand-in (the same one each time), its value its shadow."""
        got = self._metas.get(t)
        if got is None:
            got = t.to(_META)
            self._metas[t] = got
            self.shadows[got] = t
        return got

    def _shadow(self, t: torch.Tensor) -> torch.Tensor | None:
        return t if t.device.type != "meta" else self.shadows.get(t)

    def _keep(self, meta: Any, real: Any) -> None:
        """Attach the real outputs to the meta ones (the same structure)."""
        for m, r in zip(tree_flatten(meta)[0], tree_flatten(real)[0], strict=False):
            if isinstance(m, torch.Tensor) and m.device.type == "meta":
                if isinstance(r, torch.Tensor) and r.numel() <= self.max_numel:
                    self.shadows[m] = r
                else:  # an in-place write of an unknown value: the old shadow is stale
                    self.shadows.pop(m, None)

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        on_meta = any(t.device.type == "meta" for t in tensors) or any(
            isinstance(x, torch.device) and x.type == "meta" for x in flat)
        if not on_meta:  # a real op the model's code runs on real tensors (the batch)
            return func(*args, **kwargs)
        reals = [self._shadow(t) for t in tensors]
        known = all(r is not None for r in reals)
        real_out = None
        if known:
            real_args, real_kwargs = tree_map(self._to_real, (args, kwargs))
            real_out = func(*real_args, **real_kwargs)
        if func in _VALUE_OPS:
            if not known:
                raise ShapeOnlyError(
                    f"shape-only trace: {func} needs the value of a tensor computed from the "
                    "model's weights, which a meta-device model does not have")
            return tree_map(lambda r: self._meta_of(r) if isinstance(r, torch.Tensor) else r,
                            real_out)
        meta_args, meta_kwargs = tree_map(
            lambda x: self._meta_of(x) if isinstance(x, torch.Tensor)
            and x.device.type != "meta" else x, (args, kwargs))
        out = func(*meta_args, **meta_kwargs)
        if func in _OUTPUT_LIKE_FIRST and out[0].shape == meta_args[0].shape:
            out = (torch.empty_like(meta_args[0]), *out[1:])
        if known:
            self._keep(out, real_out)
        else:
            self._keep(out, tree_map(lambda _: None, out))
        return out

    def _to_real(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self._shadow(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x


def _empty_cpu(x: Any) -> Any:
    """A meta tensor as an uninitialised CPU tensor of its shape, strides and dtype."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_CPU)
    return x


#: ``torch._fused_sdp_choice``'s answer for the CPU's flash kernel (``SDPBackend``).
_FLASH = 1


class CpuAttentionKernel(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors runs the kernel the CPU runs.

    SDPA picks its kernel by device (``_fused_sdp_choice``): on meta it decomposes into the
    math path (two ``bmm``, a softmax), on a CPU it runs one flash kernel. The choice is asked
    of empty CPU tensors of the same shapes and strides (no values, no compute), and the
    CPU's flash kernel is called on the meta tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa")
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        q = bound["query"]
        if not isinstance(q, torch.Tensor) or q.device.type != "meta":
            return func(*args, **kwargs)
        with _disable_current_modes():  # the tracer must not see these empty tensors
            choice = torch._fused_sdp_choice(*tree_map(_empty_cpu, (
                bound["query"], bound["key"], bound["value"])), **tree_map(_empty_cpu, {
                    k: v for k, v in bound.items() if k not in names[:3]}))
        if choice != _FLASH:
            return func(*args, **kwargs)
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            bound["query"], bound["key"], bound["value"], bound.get("dropout_p", 0.0),
            bound.get("is_causal", False), attn_mask=bound.get("attn_mask"),
            scale=bound.get("scale"))[0]


@contextmanager
def shadowed() -> Iterator[ShadowMode]:
    """``ShadowMode`` (and ``CpuAttentionKernel``) entered for the block: enter it before
    the tracer's modes."""
    mode = ShadowMode()
    with mode, CpuAttentionKernel():
        yield mode


def trace_shapes(model: nn.Module, example_batch: Any,
                 forward: Callable[[nn.Module, Any], Any] | None = None,
                 model_name: str = "", **kwargs: Any) -> Any:
    """``autoprec.trace.trace`` of a model on the meta device: the same ``LayerGraph`` as a
    trace of the model with real weights (hooks tracer; the batch real, e.g. token ids)."""
    from autoprec.trace import trace

    with shadowed():
        return trace(model, example_batch, forward=forward, model_name=model_name,
                     tracers=("hooks",), **kwargs)


def on_meta(model: nn.Module) -> bool:
    """Whether any of the model's parameters is on the meta device (no values)."""
    return any(p.device.type == "meta" for p in model.parameters())


__all__ = ["SHADOW_MAX_NUMEL", "ShadowMode", "ShapeOnlyError", "on_meta", "shadowed",
           "trace_shapes"]
