"""One real forward, measured per module: shapes, dtypes, calls, FLOPs, element counts.

Forward hooks give each module's boundary (calls, input/output shapes and dtypes) and keep
a stack of the modules now running. ``FlopCounterMode`` sees every aten op, functional
ones included (SDPA, ``q @ k.T``) which hooks cannot; each op is attributed to the
innermost module on the stack: its *own* FLOPs. ``total_flops`` adds the op to every
module on the stack (the call tree, so a shared module counts under each caller).

The same pass tracks data flow by tensor identity (the "hooks" tracer): every tensor
remembers which GEMM-bearing modules produced it, through any number of non-GEMM ops
(views, residual adds, norms); a GEMM op in module M records an edge from each producer of
its operands to M, and its output is produced by M alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakTensorKeyDictionary

from autoprec.trace.kinds import ATTENTION_OPS, GEMM_OPS
from autoprec.workload.metrics import iter_floats


@dataclass
class ModuleStats:
    """What one module did on the measured forward (all calls together)."""

    calls: int = 0
    input_shapes: list[list[int]] = field(default_factory=list)  # first call
    output_shapes: list[list[int]] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    own_flops: int = 0
    total_flops: int = 0
    own_ops: set[str] = field(default_factory=set)  # aten op names run by its own code
    boundary_in: int = 0  # floating input elements, all calls
    boundary_out: int = 0
    gemm_in: int = 0  # non-parameter operand elements of its own GEMM ops
    gemm_out: int = 0
    inputs_from: list[str] = field(default_factory=list)  # producers of boundary inputs


@dataclass
class Measurement:
    """Per-module stats in first-call order, plus the tensor-identity data flow."""

    stats: dict[str, ModuleStats]
    order: list[str]  # module paths in order of first call
    edges: list[tuple[str, str]]  # (producer, consumer) between GEMM-bearing modules
    global_flops: int  # FlopCounterMode's total, the check on attribution


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``_scaled_dot_product_flash_attention_for_cpu`` (missing from torch's table).

    q: (..., Tq, d), k: (..., Tk, d), v: (..., Tk, dv). Two GEMMs, counted dense as torch
    counts the CUDA kernels: scores q @ k.T = 2*N*Tq*Tk*d and probs @ v = 2*N*Tq*Tk*dv, with
    N the product of leading dims of q (grouped-query k/v are broadcast to q's heads).
    """
    n = math.prod(query_shape[:-2])
    tq, d = query_shape[-2], query_shape[-1]
    tk, dv = key_shape[-2], value_shape[-1]
    return 2 * n * tq * tk * d + 2 * n * tq * tk * dv


def _custom_flops() -> dict[Any, Any]:
    table: dict[Any, Any] = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        table[op] = _sdpa_cpu_flops
    return table


def _floats(obj: Any) -> list[torch.Tensor]:
    return list(iter_floats(obj))


def _shapes(ts: list[torch.Tensor]) -> tuple[list[list[int]], list[str]]:
    return [list(t.shape) for t in ts], [str(t.dtype).replace("torch.", "") for t in ts]


class _Recorder:
    """State shared by the hooks and the flop-counting mode during one forward."""

    def __init__(self, model: nn.Module) -> None:
        self.stats: dict[str, ModuleStats] = {}
        self.order: list[str] = []
        self.stack: list[str] = []
        self.producers: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.edges: dict[tuple[str, str], None] = {}  # ordered set
        self.param_storages = {
            _storage_key(t) for t in [*model.parameters(), *model.buffers()]
        }
        self.leaves = {name for name, m in model.named_modules() if not any(m.children())}

    # -- hooks --------------------------------------------------------------------------
    def pre(self, path: str, args: tuple, kwargs: dict) -> None:
        st = self.stats.get(path)
        if st is None:
            st = self.stats[path] = ModuleStats()
            self.order.append(path)
        ins = _floats((args, kwargs))
        if st.calls == 0:
            st.input_shapes, st.input_dtypes = _shapes(ins)
        st.calls += 1
        st.boundary_in += sum(t.numel() for t in ins)
        for t in ins:
            for p in self.producers.get(t, ()):
                if p != path and p not in st.inputs_from:
                    st.inputs_from.append(p)
        self.stack.append(path)

    def post(self, path: str, output: Any) -> None:
        # always_call=True: runs even when forward raised, so the stack stays balanced.
        if self.stack and self.stack[-1] == path:
            self.stack.pop()
        st = self.stats[path]
        outs = _floats(output)
        if st.calls == 1 and not st.output_shapes:
            st.output_shapes, st.output_dtypes = _shapes(outs)
        st.boundary_out += sum(t.numel() for t in outs)

    # -- every aten op --------------------------------------------------------------------
    def op(self, name: str, flops: int, out: Any, args: tuple, kwargs: dict) -> None:
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        owner = self.stack[-1] if self.stack else None
        if owner is not None:
            st = self.stats[owner]
            st.own_ops.add(name)
            st.own_flops += flops
            for path in set(self.stack):
                self.stats[path].total_flops += flops
        if owner is not None and name in GEMM_OPS:
            srcs: set[str] = set()
            for t in ins:
                srcs.update(self.producers.get(t, ()))
            for p in sorted(srcs):
                if p != owner:
                    self.edges[(p, owner)] = None
            if owner not in self.leaves:
                st = self.stats[owner]
                acts = [t for t in ins if t.is_floating_point() and not self._is_param(t)]
                st.gemm_in += sum(t.numel() for t in acts)
                # SDPA's CPU kernel also returns logsumexp; only the attention output is data.
                first = outs[:1] if name in ATTENTION_OPS else outs
                st.gemm_out += sum(t.numel() for t in first if t.is_floating_point())
            made: frozenset[str] = frozenset((owner,))
        else:
            made = frozenset().union(*(self.producers.get(t, ()) for t in ins))
        if made:
            for o in outs:
                # An in-place op returns its input, which now also carries `made`.
                inplace = any(o is t for t in ins)
                self.producers[o] = made | self.producers.get(o, frozenset()) if inplace else made

    def _is_param(self, t: torch.Tensor) -> bool:
        try:
            return _storage_key(t) in self.param_storages
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return False


def _storage_key(t: torch.Tensor) -> int:
    """Which storage a tensor (or a view of it) reads: its address, or on the meta device
    (no data: every address is 0; ``trace.shape_only``) the storage object's own."""
    s = t.untyped_storage()
    return s._cdata if t.device.type == "meta" else s.data_ptr()


class _AttributingFlopCounter(FlopCounterMode):
    """FlopCounterMode (its op table, decompositions and module totals) that also hands
    every executed op to the recorder for per-module attribution and data flow."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(display=False, custom_mapping=_custom_flops())
        self.recorder = recorder

    def _count_flops(self, func_packet, out, args, kwargs):  # noqa: ANN001 - torch's signature
        flops = 0
        if func_packet in self.flop_registry:
            flops = int(self.flop_registry[func_packet](*args, **kwargs, out_val=out))
            for par in set(self.mod_tracker.parents):
                self.flop_counts[par][func_packet] += flops
        self.recorder.op(
            getattr(func_packet, "__name__", str(func_packet)), flops, out, args, kwargs
        )
        return out


def measure(model: nn.Module, batch: Any, forward: Callable[[nn.Module, Any], Any]) -> Measurement:
    """Run ``forward(model, batch)`` once and measure every module.

    The caller owns no_grad / eval mode; hooks are always removed, also when forward raises.
    """
    rec = _Recorder(model)
    handles = []
    try:
        for path, mod in model.named_modules():
            handles.append(
                mod.register_forward_pre_hook(
                    lambda _m, a, k, _p=path: rec.pre(_p, a, k), with_kwargs=True
                )
            )
            handles.append(
                mod.register_forward_hook(
                    lambda _m, _a, o, _p=path: rec.post(_p, o), always_call=True
                )
            )
        counter = _AttributingFlopCounter(rec)
        with counter:
            forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return Measurement(
        stats=rec.stats,
        order=rec.order,
        edges=list(rec.edges),
        global_flops=int(counter.get_total_flops()),
    )
