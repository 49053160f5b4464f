"""Which layers the probes measure, and how one of them is lowered alone.

The probed layers are the trace's GEMM nodes (Linear / Conv / HF Conv1D leaves, and
modules whose own code runs matmuls, e.g. attention). "This layer alone in precision p"
means exactly what a policy rule on it does (``lower.forward.lowered_forward``), with the
GEMM modules *inside* it (an attention module's q/k/v Linears) held at their own precision
(fp32 in an fp32 model): they are layers of their own with their own rows, so each row
measures one layer's own compute.

A 16-bit model (``autoprec.workload.reference``) is probed as it is: each layer only in the
precisions at or below its own (a bf16 Linear in bf16 — its own output, error 0 — fp16 and
the GEMM formats; tf32 is above it), and a layer probed alone hands its output on in its
own dtype, so the rest of the model runs as given.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.errors import InputError
from autoprec.formats.gemm import ineligible_reason, is_gemm_module
from autoprec.formats.precisions import GEMM_FORMATS
from autoprec.lower.forward import cast_floats, lowered_forward
from autoprec.lower.fp8 import drop_weight_caches
from autoprec.trace.graph import LayerGraph
from autoprec.workload.reference import offered, own_precision

_MISSING = object()


@dataclass
class ProbeLayer:
    """One probed layer and the precisions it is probed in."""

    path: str  # module path ("" is the root module)
    module: nn.Module
    kind: str  # the trace's kind: linear, conv, attention, matmul
    precisions: tuple[str, ...]  # requested and allowed: these get shadow computations
    disallowed: dict[str, str] = field(default_factory=dict)  # requested, not allowed: why
    inner_gemms: list[nn.Module] = field(default_factory=list)  # held at fp32 (see module doc)
    # Modules whose forward is pure in its inputs: their inputs need no snapshot.
    pure: bool = False
    own: str = "fp32"  # the precision the layer is stored in (autoprec.workload.reference)

    @property
    def name(self) -> str:
        return self.path or "<root>"


def _is_pure(module: nn.Module) -> bool:
    """Leaves that never write their inputs: the forward hook may read the inputs directly."""
    if any(True for _ in module.children()):
        return False
    return is_gemm_module(module)


def select_layers(model: nn.Module, graph: LayerGraph, precisions: Sequence[str],
                  layers: Sequence[str] | None = None) -> list[ProbeLayer]:
    """The graph's GEMM nodes (execution order), restricted to ``layers`` when given.

    A precision the graph disallows (e.g. fp8 on a 10-wide head) is kept as a reason. fp8
    computes only in Linear-like leaves, so a module whose own code runs the matmuls (an
    attention module) cannot take fp8 itself; an fp8 rule on it lowers its Linear children,
    which have their own rows.
    """
    modules = dict(model.named_modules())
    gemms = [n for n in graph.gemm_nodes if n.path in modules]
    if layers is not None:
        known = {n.path for n in gemms}
        for path in layers:
            if path not in known:
                what = "is not a module of the model" if path not in modules else (
                    "runs no matmul/conv of its own (not a GEMM layer)")
                raise InputError(f"layers: {path!r} {what}")
        wanted = set(layers)
        chosen = [n for n in gemms if n.path in wanted]
    else:
        chosen = gemms
    gemm_paths = [n.path for n in gemms]
    out = []
    for node in chosen:
        module = modules[node.path]
        disallowed = {p: f"{p}: {node.disallowed[p]}" for p in precisions if p in node.disallowed}
        own = own_precision(module)
        # above the layer's own precision (tf32 for a bf16 layer): no row, as for a
        # precision the target lacks; the layer as given needs no shadow run: its error
        # is 0 (``SensitivityTable.estimate``)
        skip = {p for p in precisions if p not in offered(own, [p])}
        if own != "fp32":
            skip.add(own)
        prefix = node.path + "." if node.path else ""
        inner = [modules[p] for p in gemm_paths if p != node.path and p.startswith(prefix)]
        for f in GEMM_FORMATS:
            if f in precisions and f not in disallowed:
                why = ineligible_reason(module, f)
                if why is not None:
                    disallowed[f] = (_container_reason(f, module, inner)
                                     if node.kind in ("attention", "matmul") else why)
        out.append(ProbeLayer(
            path=node.path, module=module, kind=node.kind,
            precisions=tuple(p for p in precisions if p not in disallowed
                             and p not in skip),
            disallowed=disallowed, inner_gemms=inner, pure=_is_pure(module), own=own,
        ))
    return out


def _container_reason(fmt: str, module: nn.Module, inner: list[nn.Module]) -> str:
    """Why a module whose own code runs matmuls (attention) is not a fp8 choice itself,
    in one statement: the format lowers Linear leaves, so a rule on it reaches those."""
    n = sum(1 for m in inner
            if next(iter(m.children()), None) is None and ineligible_reason(m, fmt) is None)
    reach = (f"a {fmt} rule on this {type(module).__name__} lowers its {n} eligible Linear "
             f"layer{'s' if n != 1 else ''}" if n else
             f"a {fmt} rule on this {type(module).__name__} reaches no eligible Linear layer")
    return f"{fmt} applies to Linear leaves: {reach}; its own matmuls stay in its region"


@contextlib.contextmanager
def swapped_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Install ``forward`` as ``module.forward`` (an instance attribute) until exit."""
    prev = module.__dict__.get("forward", _MISSING)
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if prev is _MISSING:
            del module.__dict__["forward"]
        else:
            module.forward = prev  # type: ignore[method-assign]


@contextlib.contextmanager
def inner_fp32(layer: ProbeLayer) -> Iterator[None]:
    """Hold the GEMM modules inside ``layer`` at fp32, or at their own precision with the
    output upcast to fp32 (exact) in a 16-bit model: the container's own code then meets
    fp32 tensors, as in an fp32 model (bf16 and fp16 meeting in one of autocast's promote
    ops, a rotary ``cat``, would be refused)."""
    with contextlib.ExitStack() as stack:
        for m in layer.inner_gemms:
            own = own_precision(m)
            low = lowered_forward(m, own)
            if own != "fp32":
                low = _upcast_outputs(low)
            stack.enter_context(swapped_forward(m, low))
        yield


def _upcast_outputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return cast_floats(fn(*args, **kwargs), torch.float32)

    return forward



def lowered_call(layer: ProbeLayer, precision: str, args: Sequence[Any], kwargs: dict[str, Any],
                 fp8_backend: str = "emulated") -> Any:
    """Run ``layer``'s forward once in ``precision`` (its inner GEMMs at fp32); no hooks of
    the layer itself fire (the forward is called directly, not through ``__call__``)."""
    with inner_fp32(layer):
        fwd = lowered_forward(layer.module, precision, fp8_backend=fp8_backend)
        return fwd(*args, **kwargs)


@contextlib.contextmanager
def lowered_alone(layer: ProbeLayer, precision: str,
                  fp8_backend: str = "emulated") -> Iterator[None]:
    """The model with only ``layer`` computing in ``precision``; everything else as given.

    The layer's outputs are cast on the way out to the dtype its input came in (fp32 in an
    fp32 model; a bf16 model's layer hands on bf16, as it does unlowered) — what its
    consumer does with them (docs/overview.md: a fp32 layer upcasts its inputs) — so the run measures
    this layer's rounding and nothing else: without it, a bf16 ``query`` next to fp32
    ``key``/``value`` fails in SDPA ("Expected query, key, and value to have the same
    dtype") and a 16-bit activation would re-round every non-GEMM op it passes through.
    """
    low = lowered_forward(layer.module, precision, fp8_backend=fp8_backend)

    @functools.wraps(low)
    def forward(*args: Any, **kwargs: Any) -> Any:
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                  and a.dtype in (torch.bfloat16, torch.float16)), None)
        if x is None:  # fp32 in: fp32 out, as in an fp32 model
            return cast_floats(low(*args, **kwargs), torch.float32)
        return cast_floats(low(*args, **kwargs), x.dtype,
                           (torch.float32, torch.bfloat16, torch.float16))

    try:
        with inner_fp32(layer), swapped_forward(layer.module, forward):
            yield
    finally:  # the run's quantised weight goes with it: one layer's copy at a time
        drop_weight_caches(layer.module)
