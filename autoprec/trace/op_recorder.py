"""Record one real forward op by op into an ``OpTrace`` (``autoprec.trace.ops``).

``record_ops`` runs the model once (fp32, no policy) and keeps every kernel-level op with
the module whose own code ran it, the tensors it read and wrote, and every module call with
its inputs and outputs.

Two levels are recorded, chosen so that a replay under autocast sees what autocast sees:

- *Functions* that autocast registers at the function level and that decompose differently
  per device are one op each (their insides are hidden): ``linear``, convolutions, SDPA
  (CPU runs a different kernel than CUDA's fused attention; one fused op is what a CUDA
  target runs), embedding, and explicit casts (``Tensor.to``/``float``/``half``/...): a
  ``.float()`` of an fp32 tensor is a no-op that dispatch never sees, but under a bf16 plan
  it is a real cast.
- Everything else at the aten level (``TorchDispatchMode``): pointwise ops, reductions,
  norms, softmax, views (free), copies, factories.

Known limits (documented in the README): Python code whose control flow or dtype choice
depends on the dtype it sees (``x.to(q.dtype)``) is replayed as traced in fp32; activations
are assumed to scale linearly with the batch (values derived from the model input, or
created with the calibration batch as their leading dimension).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from autoprec.lower.stored import consumer_kind
from autoprec.trace.op_recipes import op_recipe
from autoprec.trace.ops import DTYPE_NAMES, Call, Op, OpTrace, Value

# -- what is recorded at the function level -------------------------------------------------

_F = torch.nn.functional
_GEMM_FUNCS: dict[Callable[..., Any], str] = {
    _F.linear: "linear", _F.conv1d: "conv", _F.conv2d: "conv", _F.conv3d: "conv",
    _F.conv_transpose1d: "conv", _F.conv_transpose2d: "conv", _F.conv_transpose3d: "conv",
}
_SDPA = _F.scaled_dot_product_attention
_EMBEDDING = _F.embedding
#: Names in ``torch.nn.functional`` that its own Python functions call as globals and that
#: are recorded as one op (see ``_inner_calls_recorded``).
_INNER = ("linear", "scaled_dot_product_attention")
#: Precision name -> torch dtype (the model's own dtype, for Op.ambient).
_DTYPE_OF = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Explicit casts: recorded even when they are no-ops at trace time.
_CAST_METHODS: dict[Any, torch.dtype | None] = {
    torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64,
    torch.Tensor.to: None, torch.Tensor.type_as: None, torch.Tensor.type: None,
}


def _dtype_arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype an explicit cast asks for (None: not a dtype change, e.g. .to(device))."""
    fixed = _CAST_METHODS[func]
    if fixed is not None:
        return fixed
    if "dtype" in kwargs and isinstance(kwargs["dtype"], torch.dtype):
        return kwargs["dtype"]
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            return a
    return None


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _is_view_op(func: Any) -> bool:
    """aten ops whose output aliases an input without computing (view, t, permute...)."""
    try:
        schema = func._schema
    except AttributeError:
        return False
    if schema.is_mutable:
        return False
    return any(r.alias_info is not None for r in schema.returns)


def _mutated_self(func: Any) -> bool:
    try:
        args = func._schema.arguments
    except AttributeError:
        return False
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _dtype_name(dt: torch.dtype) -> str:
    return DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))



def _matmul_flops(a: torch.Tensor, b: torch.Tensor) -> float:
    """2*m*k*n per (broadcast) batch for a @ b with a (..., m, k), b (..., k, n)."""
    if a.dim() == 1 or b.dim() == 1:
        return 2.0 * a.numel() * (b.shape[-1] if b.dim() > 1 else 1)
    batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class _Recorder:
    """Shared state of the hooks and the two modes during the recorded forward."""

    def __init__(self, model: nn.Module, batch_size: int) -> None:
        self.trace = OpTrace(modules=[p for p, _ in model.named_modules()],
                             batch_size=batch_size)
        self.index = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        self.trace.consumers = [consumer_kind(m) for _, m in model.named_modules()]
        self.ids: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.keep: list[torch.Tensor] = []  # keeps recorded tensors alive (ids stay unique)
        self.stack: list[int] = []
        self.open: list[int] = []  # calls entered and not yet left
        self.hidden = 0  # > 0 inside a function recorded as one op
        # a 16-bit model: casts to its own dtype follow the plan (Op.ambient); an fp32
        # model's `.to(torch.float32)` and `.to(input_dtype)` cannot be told apart: none
        from autoprec.workload.reference import model_reference

        ref = model_reference(model).default
        self.ambient = _DTYPE_OF.get(ref) if ref != "fp32" else None
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            self._new(t, "param", scales=False, param=name)
        # a streamed model's blocks hold their weights without gradients (stream.streamed:
        # memory); the model they stand for trains them
        stream = getattr(model, "autoprec_stream", None)
        untracked = stream.trainable if stream is not None else frozenset()
        for name, t in model.named_parameters():
            self.trace.values[self.ids[t]].trainable = t.requires_grad or name in untracked
        owners: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            owners.setdefault(self.ids[t], []).append(name.rpartition(".")[0])
        for vid, paths in owners.items():  # a tied weight: each owner stores its own copy
            if len(set(paths)) > 1:
                self.trace.values[vid].owners = tuple(dict.fromkeys(paths))

    # -- values ------------------------------------------------------------------------------
    def _new(self, t: torch.Tensor, source: str, scales: bool, param: str = "") -> int:
        vid = len(self.trace.values)
        self.trace.values.append(Value(t.numel(), _dtype_name(t.dtype), t.element_size(),
                                       source, scales, t.dim(), param))
        self.ids[t] = vid
        self.keep.append(t)
        return vid

    def follow(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` replaces the parameter ``old`` (a streamed model's load): one value."""
        got = self.ids.get(old)
        if got is not None:
            self.ids[new] = got

    def vid(self, t: torch.Tensor) -> int:
        """The id of a tensor read by an op; an unknown tensor is a model input."""
        got = self.ids.get(t)
        if got is not None:
            return got
        return self._new(t, "input", scales=True)

    def outputs(self, outs: list[torch.Tensor], ins: list[int], view: bool) -> tuple[int, ...]:
        vals = self.trace.values
        scales = any(vals[i].scales for i in ins)
        # A view of a parameter (``weight.t()``) is still the parameter: not scaled, and
        # under autocast it is cast on every call like the weight itself.
        source = "param" if view and ins and vals[ins[0]].source == "param" else "op"
        made = []
        for t in outs:
            s = scales or (not ins and t.dim() > 0 and t.shape[0] == self.trace.batch_size
                           and self.trace.batch_size > 1)
            made.append(self._new(t, source, s))
        return tuple(made)

    # -- ops ---------------------------------------------------------------------------------
    def op(self, name: str, kind: str, args: Any, out: Any, *, flops: float = 0.0,
           fixed: str | None = None, like_first: bool = False,
           weight: torch.Tensor | None = None, func: Any = None) -> None:
        """Record one op. Its outputs get new value ids, also an in-place op's (its result
        is a new version of the tensor, with the dtype ``like`` says). ``func``: the
        function that ran with ``args`` = (args, kwargs), kept as the op's recipe."""
        ins = [self.vid(t) for t in _tensors(args)]
        ins = list(dict.fromkeys(ins))
        recipe = op_recipe(func, *args, self.vid) if func is not None else None
        outs = self.outputs(_tensors(out), ins, kind == "view")
        op = Op(name, kind, self.stack[-1] if self.stack else -1, tuple(ins), outs, flops,
                fixed, ins[0] if like_first and ins else None,
                self.ids.get(weight) if weight is not None else None, recipe=recipe)
        self.trace.events.append((0, len(self.trace.ops)))
        self.trace.ops.append(op)

    def mark_ambient(self, op: Op, target: torch.dtype) -> None:
        """A 16-bit model's cast to its own dtype: HF's ``x.to(input_dtype)`` after an fp32
        norm, ``cos.to(x.dtype)``. It follows the dtype the enclosing module's input
        arrived in (``like`` that input) when that input had the target dtype here, else
        the storage dtype of the region it runs in (``Op.ambient``)."""
        name = _dtype_name(target)
        if self.open:
            for v in self.trace.calls[self.open[-1]].inputs:
                if self.trace.values[v].dtype == name and v not in op.outputs:
                    op.like = v
                    return
        op.ambient = True

    # -- module calls ------------------------------------------------------------------------
    def enter(self, module: nn.Module, args: Any) -> None:
        m = self.index.get(id(module), -1)
        ins = tuple(dict.fromkeys(self.vid(t) for t in _tensors(args)))
        self.trace.events.append((1, len(self.trace.calls)))
        self.trace.calls.append(Call(m, ins))
        self.stack.append(m)
        self.open.append(len(self.trace.calls) - 1)

    def exit(self, output: Any) -> None:
        if not self.stack:
            return
        self.stack.pop()
        c = self.open.pop()
        self.trace.calls[c].outputs = tuple(dict.fromkeys(
            self.vid(t) for t in _tensors(output)))
        self.trace.events.append((2, c))


class _Functions(TorchFunctionMode):
    """Records linear/conv/SDPA/embedding/explicit casts as one op each."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        rec = self.rec
        if rec.hidden:
            return func(*args, **kwargs)
        kind = None
        if func in _GEMM_FUNCS:
            kind = "gemm"
        elif func is _SDPA:
            kind = "attention"
        elif func is _EMBEDDING:
            kind = "embedding"
        elif func in _CAST_METHODS:
            kind = "cast"
        if kind is None:
            if _functional_composite(func):
                with _inner_calls_recorded(self):
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        rec.hidden += 1
        try:
            out = func(*args, **kwargs)
        finally:
            rec.hidden -= 1
        if kind == "cast":
            self._cast(func, args, kwargs, out)
        elif kind == "gemm":
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if func is _F.linear:
                flops = 2.0 * x.numel() * w.shape[0]
            else:
                from torch.utils.flop_counter import conv_flop_count

                flops = float(conv_flop_count(list(x.shape), list(w.shape), list(out.shape),
                                              transposed="transpose" in func.__name__))
            rec.op(_GEMM_FUNCS[func], "gemm", (args, kwargs), out, flops=flops, weight=w,
                   func=func)
        elif kind == "attention":
            q = args[0] if args else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            v = args[2] if len(args) > 2 else kwargs["value"]
            # scores q @ k^T and probs @ v: 2*N*Tq*Tk*(d + dv), N = q's leading dims
            n = math.prod(q.shape[:-2])
            flops = 2.0 * n * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
            rec.op("scaled_dot_product_attention", "attention", (args, kwargs), out,
                   flops=flops, func=func)
        else:  # embedding: reads the gathered rows of the table
            rec.op("embedding", "embedding", (args, kwargs), out, func=func)
        return out

    def _cast(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        rec = self.rec
        src = args[0]
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        if func is torch.Tensor.type_as:
            like = rec.vid(args[1])
            rec.op("type_as", "cast", (src,), out)
            rec.trace.ops[-1].like = like
            return
        target = _dtype_arg(func, args, kwargs)
        if target is None and func is torch.Tensor.to:
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            if other is not None:
                target = other.dtype
        if target is None:
            if out is not src:  # a device move or the like: a copy, priced as one
                rec.op("to", "pointwise", (src,), out)
            return
        # A no-op cast returns its input: from here on the tensor stands for the cast's
        # result (``x = x.float()``), which under a 16-bit plan is a new tensor.
        rec.op("to", "cast", (src,), out, fixed=_dtype_name(target))
        if target == rec.ambient:
            rec.mark_ambient(rec.trace.ops[-1], target)


def _functional_composite(func: Any) -> bool:
    """A Python function of ``torch.nn.functional`` that reached the mode through
    ``handle_torch_function`` (``F.multi_head_attention_forward``)."""
    return inspect.isfunction(func) and func.__module__ == "torch.nn.functional"


@contextlib.contextmanager
def _inner_calls_recorded(mode: _Functions) -> Iterator[None]:
    """Record the ``linear`` and SDPA calls inside a ``torch.nn.functional`` composite as one
    op each, as everywhere else.

    torch pops a function mode while its ``__torch_function__`` runs, so the body of
    ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` with torch.nn's fast path
    off, as apply leaves it) would reach only the aten mode: its in-projection as ``mm`` +
    bias ``add``, its SDPA as the CPU kernel's aten op. Autocast sees ``linear`` and SDPA
    there (it casts the bias with the weight and runs the attention in 16 bits), so the
    replay must too. The body calls both through ``torch.nn.functional``'s globals; they
    are pointed at the mode for the call and restored after it."""
    saved = {name: getattr(_F, name) for name in _INNER}

    def recorded(func: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return mode.__torch_function__(func, (), args, kwargs)
        return call

    try:
        for name, func in saved.items():
            setattr(_F, name, recorded(func))
        yield
    finally:
        for name, func in saved.items():
            setattr(_F, name, func)


class _Aten(TorchDispatchMode):
    """Records every aten op that runs outside a function recorded as one op."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        if rec.hidden:
            return out
        name = func.overloadpacket.__name__
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        if not outs:
            return out
        if _is_view_op(func):
            rec.op(name, "view", (args, kwargs), out, like_first=True, func=func)
            return out
        fixed = None
        if not any(t.is_floating_point() for t in ins) or not outs[0].is_floating_point():
            fixed = _dtype_name(outs[0].dtype)
        elif isinstance(kwargs.get("dtype"), torch.dtype):
            fixed = _dtype_name(kwargs["dtype"])
        kind = "factory" if not ins else "pointwise"
        ambient = False
        if name == "_to_copy" and ins and ins[0].dtype != outs[0].dtype:
            kind = "cast"  # a conversion the model's code asked for (e.g. mask.bool())
            fixed = _dtype_name(outs[0].dtype)
            ambient = ins[0].is_floating_point() and outs[0].dtype == rec.ambient
        if name in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot",
                    "convolution", "_convolution"):
            kind = "gemm"
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addbmm", "addmv") else (
                args[0], args[1])
            flops = _matmul_flops(a, b) if "conv" not in name else 0.0
            rec.op(name, kind, (args, kwargs), out, flops=flops, fixed=fixed, func=func)
            return out
        rec.op(name, kind, (args, kwargs), out, fixed=fixed, like_first=_mutated_self(func),
               func=None if kind == "cast" else func)
        if ambient:
            rec.mark_ambient(rec.trace.ops[-1], outs[0].dtype)
        return out


def record_ops(model: nn.Module, batch: Any, forward: Callable[[nn.Module, Any], Any],
               batch_size: int) -> OpTrace:
    """Run ``forward(model, batch)`` once and record its ops (the caller owns no_grad/eval).

    Hooks are always removed, also when forward raises.
    """
    rec = _Recorder(model, batch_size)
    handles = []
    # a model streamed from its checkpoint (autoprec.stream) replaces a block's parameters
    # when it loads and offloads them: the new objects are the same values of the trace
    listeners = getattr(getattr(model, "autoprec_stream", None), "listeners", None)
    follow = rec.follow
    if listeners is not None:
        listeners.append(follow)
    try:
        for mod in model.modules():
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, k: rec.enter(m, (a, k)), with_kwargs=True))
            handles.append(mod.register_forward_hook(
                lambda _m, _a, o: rec.exit(o), always_call=True))
        with _Functions(rec), _Aten(rec):
            forward(model, batch)
    finally:
        for h in handles:
            h.remove()
        if listeners is not None:
            listeners.remove(follow)
    return rec.trace


__all__ = ["record_ops"]
