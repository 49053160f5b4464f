"""Shadow computation: every layer's lowered output, from its fp32 inputs, in one pass.

The model runs once in fp32 over a batch. A forward hook on every probed layer re-runs
that layer's forward on the *same fp32 inputs* in each probed precision (the way a policy
lowers it, ``layers.lowered_call``) and compares with the fp32 output it just produced:

    local_error(layer, p) = sqrt(Σ ||y_p - y_fp32||²) / sqrt(Σ ||y_fp32||²)   over all calls

So one fp32 pass plus, per precision, one lowered evaluation of every layer replaces
``layers × precisions`` whole-model passes. The hooks also count ranges (ranges.py) and,
when the gradient passes need them, keep each call's error ``y_p - y_fp32`` and the
gradient edge of its output (``torch.autograd.graph.get_gradient_edge``: the edge is taken
before any downstream in-place op, e.g. ``ReLU(inplace=True)``, can move it).

Hooks are inert while a shadow computation runs (children of an attention module would
otherwise probe themselves again inside its re-run).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from autoprec.errors import AutoprecError
from autoprec.fused import fused_paths_off
from autoprec.lower.fp8 import drop_weight_caches
from autoprec.probe.layers import ProbeLayer, lowered_call
from autoprec.probe.ranges import TensorRange
from autoprec.workload.metrics import iter_floats, relative_error

#: The dtype a call's ``y_p - y_fp32`` is kept in for the gradient passes: they only enter
#: dot products summed into an error estimate, where bf16's 8-bit mantissa (0.4 %) is far
#: below the estimate's own spread; half the bytes of an fp32 copy per call and precision.
DELTA_DTYPE = torch.bfloat16

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


@dataclass
class LocalStats:
    """Accumulated local error of one (layer, precision) over calls and batches."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    nonfinite: int = 0  # NaN/inf in the lowered output where fp32 was finite
    calls: int = 0

    @property
    def error(self) -> float:
        if not self.calls:
            return math.nan  # the layer did not run on this data
        return relative_error(self.sq_err, self.sq_ref, self.nonfinite)


@dataclass
class Call:
    """One call of a probed layer in the current batch, kept for the gradient passes."""

    layer: ProbeLayer
    outputs: int  # floating output tensors
    edges: list[GradientEdge | None]  # one per floating output (None: not differentiable)
    deltas: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # p -> y_p - y_fp32
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # fp32 (args, kwargs)


def snapshot(obj: Any, memo: dict[int, Any]) -> Any:
    """A copy of a forward's arguments that the forward itself cannot change.

    Tensors are cloned; containers rebuilt; other objects (an HF KV-cache the attention
    appends to) deep-copied with the model's modules and parameters shared via ``memo``.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, tuple):
        items = [snapshot(v, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [snapshot(v, memo) for v in obj]
    if type(obj) is dict:
        return {k: snapshot(v, memo) for k, v in obj.items()}
    try:
        return copy.deepcopy(obj, dict(memo))
    except Exception:  # not copyable: share it (a forward that mutates it is rare)
        return obj


def _float_list(obj: Any) -> list[torch.Tensor]:
    return list(iter_floats(obj))


class ShadowPass:
    """Context manager holding the probe hooks on ``layers`` (removed on exit).

    ``track`` keeps, per call, the lowered-minus-fp32 errors and the output's gradient
    edge (for ``grads.py``); ``keep_inputs`` also keeps the fp32 inputs (gradient probes).
    """

    def __init__(self, model: nn.Module, layers: Sequence[ProbeLayer], fp8_backend: str = "emulated",
                 track: bool = False, keep_inputs: bool = False) -> None:
        self.layers = list(layers)
        self.fp8_backend = fp8_backend
        self.track = track
        self.keep_inputs = keep_inputs
        self.local: dict[tuple[str, str], LocalStats] = {}
        self.ranges: dict[str, dict[str, TensorRange]] = {}
        self.calls: list[Call] = []
        self.busy = False
        self._handles: list[Any] = []
        self._pending: dict[int, list[Any]] = {}
        #: layers of a streamed model (``autoprec.stream``) whose weights are on ``meta``
        #: until their block runs: their weight range is counted at their first call
        self._weights_later: set[str] = set()
        # Shared, never copied, by snapshot(): the model's own modules and tensors.
        self._memo: dict[int, Any] = {id(m): m for m in model.modules()}
        self._memo.update({id(t): t for t in [*model.parameters(), *model.buffers()]})

    # -- hooks -----------------------------------------------------------------------------

    def __enter__(self) -> ShadowPass:
        for layer in self.layers:
            w = TensorRange()
            if any(p.device.type == "meta" for p in layer.module.parameters(recurse=False)):
                self._weights_later.add(layer.path)  # streamed: counted when it is loaded
            else:
                w.add(layer.module.parameters(recurse=False),
                      [*layer.precisions, *layer.disallowed])
            self.ranges[layer.path] = {"in": TensorRange(), "w": w, "out": TensorRange()}
            for p in layer.precisions:
                self.local[(layer.path, p)] = LocalStats()
            m = layer.module
            self._handles.append(m.register_forward_pre_hook(self._pre(layer), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def take_calls(self) -> list[Call]:
        """This batch's calls (and forget them)."""
        calls, self.calls = self.calls, []
        return calls

    def _pre(self, layer: ProbeLayer):  # -> hook
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.busy:
                return
            if layer.path in self._weights_later:
                self._weights_later.discard(layer.path)
                self.ranges[layer.path]["w"].add(module.parameters(recurse=False),
                                                 [*layer.precisions, *layer.disallowed])
            # A pure leaf (Linear/Conv) cannot change its inputs: no copy needed.
            saved = None if layer.pure else (snapshot(args, self._memo),
                                             snapshot(kwargs, self._memo))
            self._pending.setdefault(id(module), []).append(saved)

        return hook

    def _post(self, layer: ProbeLayer):  # -> hook
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> Any:
            if self.busy:
                return None
            saved = self._pending[id(module)].pop()
            if saved is not None:
                args, kwargs = saved
            self.busy = True
            try:
                return self._probe_call(layer, args, kwargs, output)
            finally:
                self.busy = False

        return hook

    # -- one call --------------------------------------------------------------------------

    def _probe_call(self, layer: ProbeLayer, args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: Any) -> Any:
        refs = [t.detach() for t in _float_list(output)]
        ranged = [*layer.precisions, *layer.disallowed]
        rng = self.ranges[layer.path]
        rng["in"].add(_float_list((args, kwargs)), ranged)
        rng["out"].add(refs, ranged)
        call = Call(layer, len(refs), [])
        # Per reference: fp32 copy, finite mask (None: all finite, the common case, found
        # with one reduction instead of an isfinite pass per precision) and its sum of squares.
        ref_info = [_ref_info(ref) for ref in refs]
        for p in layer.precisions:
            with torch.no_grad(), fused_paths_off():
                lows = _float_list(lowered_call(layer, p, args, kwargs, self.fp8_backend))
            if len(lows) != len(refs):
                raise AutoprecError(
                    f"probe: {layer.name} in {p} returned {len(lows)} floating tensors, "
                    f"in fp32 {len(refs)}")
            st = self.local[(layer.path, p)]
            st.calls += 1
            deltas = []
            for low, (ref32, ok, sq_ref) in zip(lows, ref_info):
                low32 = low.detach().float()
                d = low32 - ref32
                if ok is None:
                    sq = float(d.pow(2).sum())
                    if math.isfinite(sq):
                        st.sq_err += sq
                        st.sq_ref += sq_ref
                        deltas.append(d)
                        continue
                    ok = torch.ones_like(ref32, dtype=torch.bool)
                bad = ok & ~torch.isfinite(low32)
                st.nonfinite += int(bad.sum())
                # (y_p - y_fp32) where fp32 is finite; inf/NaN stay in (they mean "broken").
                d = torch.where(ok, d, torch.zeros((), device=ref32.device))
                st.sq_err += float(torch.where(bad, 0.0, d).pow(2).sum())
                st.sq_ref += sq_ref
                deltas.append(d)
            # one layer's quantised weight at a time: its lowered call's cache goes now
            drop_weight_caches(layer.module)
            if self.track:  # kept for the projections' dot products only: bf16 suffices
                call.deltas[p] = [d.to(DELTA_DTYPE) for d in deltas]
        if not self.track:
            return None
        if self.keep_inputs:
            call.inputs = (snapshot(args, self._memo), snapshot(kwargs, self._memo))
        output, call.edges = _track_output(output)
        self.calls.append(call)
        return output


def _ref_info(ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(fp32 copy, finite mask or None when all finite, sum of squares of finite values)."""
    ref32 = ref.float()
    sq = float(ref32.pow(2).sum())
    if math.isfinite(sq):
        return ref32, None, sq
    ok = torch.isfinite(ref32)
    return ref32, ok, float(torch.where(ok, ref32, 0.0).pow(2).sum())


def _track_output(output: Any) -> tuple[Any, list[GradientEdge | None]]:
    """Gradient edges of the output's floating tensors, in ``iter_floats`` order.

    An output that does not require grad (frozen weights, integer inputs) is replaced by
    ``leaf * 1`` on a fresh leaf, so the rest of the forward builds a graph to it; only
    tensor / tuple / list outputs can be replaced (others get no edge: no estimate).
    """
    if not torch.is_grad_enabled():
        return output, [None] * len(_float_list(output))
    edges: list[GradientEdge | None] = []
    new = _visit(output, True, edges)
    return new, edges


def _visit(obj: Any, replace: bool, edges: list[GradientEdge | None]) -> Any:
    """``_track_output``'s walk. A module-level function, not a closure calling itself: a
    recursive closure is a reference cycle (function -> cell -> function) that kept each
    call's outputs and their graph alive until the cycle collector ran."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj
        if obj.requires_grad:
            edges.append(get_gradient_edge(obj))
            return obj
        if not replace:
            edges.append(None)
            return obj
        leaf = obj.detach().requires_grad_(True)
        edges.append(get_gradient_edge(leaf))
        return leaf * 1  # a non-leaf: downstream in-place ops are allowed on it
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_visit(v, replace, edges) for v in obj)
    for t in iter_floats(obj):  # dicts, ModelOutput, dataclasses: read, never rebuilt
        _visit(t, False, edges)
    return obj
