"""Trace a model into a ``LayerGraph``: every module measured on one real forward, plus the
data flow between GEMM-bearing modules from the first tracer that works
(``torch.fx`` → ``torch.export(strict=False)`` → tensor identity through forward hooks).

Tracing never changes the model: it runs under ``torch.no_grad()`` in eval mode (so
BatchNorm statistics stay put), removes its hooks, restores every module's attributes
(training flags, anything forward cached on ``self``), and checks that no parameter or
buffer was written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from autoprec.errors import AutoprecError
from autoprec.formats.precisions import GEMM_FORMATS
from autoprec.fused import fused_paths_off
from autoprec.io.paths import unwrap_model
from autoprec.trace.graph import GEMM_KINDS, KINDS, LayerGraph, LayerNode, fingerprint
from autoprec.trace.kinds import classify, eligibility, format_reason
from autoprec.trace.measure import Measurement, measure
from autoprec.trace.op_recorder import record_ops
from autoprec.trace.ops import OpTrace
from autoprec.trace.structure import GemmLayout, TraceFailed, export_edges, fx_edges
from autoprec.workload.loading import default_forward
from autoprec.workload.metrics import batch_size_of

__all__ = ["GEMM_KINDS", "KINDS", "LayerGraph", "LayerNode", "OpTrace", "TRACERS", "fingerprint",
           "trace"]

#: The tracers, in the order they are tried.
TRACERS = ("fx", "export", "hooks")


def trace(
    model: nn.Module,
    example_batch: Any,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    leaf_modules: Iterable[type | str] | None = None,
    model_name: str = "",
    tracers: Sequence[str] = TRACERS,
    export_timeout: float | None = 60.0,
) -> LayerGraph:
    """Measure every module of ``model`` on ``example_batch`` and trace its data flow.

    Args:
        forward: ``forward(model, batch)``; default ``model(batch)`` / ``(*batch)`` /
            ``(**batch)`` as in model.py's contract.
        leaf_modules: module types or paths fx must not trace into.
        tracers: graph tracers to try, in order; "hooks" (always works) is appended when
            missing. ``("hooks",)`` skips fx and export (fastest).
        export_timeout: seconds before export is given up (main thread only); None: no limit.

    Raises whatever ``forward`` raises on the real forward (the caller decides whether
    that is the user's error); AutoprecError if tracing changed the model (a bug).
    """
    unknown = [t for t in tracers if t not in TRACERS]
    if unknown:
        raise ValueError(f"unknown tracer {unknown[0]!r}; expected some of {', '.join(TRACERS)}")
    forward = forward or default_forward
    model = unwrap_model(model)
    saved = _snapshot(model)
    versions = _versions(model)
    try:
        model.eval()
        # What runs under a policy: torch.nn's fused paths off (autoprec/fused.py), so the
        # modules they skip are called and MultiheadAttention's projections are counted.
        with torch.no_grad(), fused_paths_off():
            meas = measure(model, example_batch, forward)
            nodes = _build_nodes(model, meas)
            layout = _layout(model, nodes)
            tracer, edges, fallbacks = _data_flow(
                model, example_batch, forward, layout, meas, leaf_modules, tracers, export_timeout
            )
            _restore(saved)  # fx/export ran the model's Python on proxies: clean state first
            model.eval()
            ops = record_ops(model, example_batch, forward, batch_size_of(example_batch) or 1)
    finally:
        _restore(saved)
    if _versions(model) != versions:
        raise AutoprecError("tracing wrote to the model's parameters or buffers (a bug)")
    gemm_in: dict[str, list[str]] = {}
    for src, dst in edges:
        gemm_in.setdefault(dst, []).append(src)
    for node in nodes.values():
        if node.is_gemm and node.calls:
            node.inputs_from = gemm_in.get(node.path, [])
    return LayerGraph(
        nodes=nodes,
        tracer=tracer,
        fallbacks=fallbacks,
        fingerprint=fingerprint(model),
        batch_size=batch_size_of(example_batch) or 1,
        model_name=model_name,
        edges=edges,
        ops=ops,
    )


_Snapshot = list[tuple[nn.Module, dict[str, Any], dict[str, dict[str, Any]]]]
_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _snapshot(model: nn.Module) -> _Snapshot:
    """Every module's attributes (shallow): training flags, and whatever forward might set.

    fx and export run the model's Python on proxies / fake tensors; a forward that caches
    a tensor on ``self`` (a mask, a rotary table) would otherwise keep a Proxy afterwards.
    """
    return [
        (m, dict(m.__dict__), {k: dict(getattr(m, k)) for k in _REGISTRIES})
        for m in model.modules()
    ]


def _restore(saved: _Snapshot) -> None:
    for m, attrs, registries in saved:
        for key in [k for k in m.__dict__ if k not in attrs]:
            del m.__dict__[key]
        m.__dict__.update(attrs)
        for key, entries in registries.items():
            registry = getattr(m, key)
            registry.clear()
            registry.update(entries)


def _versions(model: nn.Module) -> list[int]:
    """In-place writes bump a tensor's version counter; reading does not."""
    return [t._version for t in [*model.parameters(), *model.buffers()]]


def _build_nodes(model: nn.Module, meas: Measurement) -> dict[str, LayerNode]:
    """One node per module: first-call order, then modules that never ran (calls == 0)."""
    modules = dict(model.named_modules())
    order = [p for p in meas.order if p in modules]
    order += [p for p in modules if p not in meas.stats]
    nodes: dict[str, LayerNode] = {}
    for path in order:
        mod = modules[path]
        st = meas.stats.get(path)
        has_children = any(True for _ in mod.children())
        own_ops = st.own_ops if st else set()
        kind = classify(mod, own_ops, has_children)
        params = sum(p.numel() for p in mod.parameters(recurse=False))
        node = LayerNode(
            path=path,
            module_type=type(mod).__name__,
            kind=kind,
            is_leaf=not has_children,
            depth=0 if path == "" else path.count(".") + 1,
            params=params,
        )
        if st is not None:
            node.input_shapes, node.input_dtypes = st.input_shapes, st.input_dtypes
            node.output_shapes, node.output_dtypes = st.output_shapes, st.output_dtypes
            node.calls = st.calls
            node.flops, node.total_flops = st.own_flops, st.total_flops
            node.weight_elems = params * st.calls
            if not has_children:  # a leaf's own compute reads its inputs, writes its outputs
                node.in_elems, node.out_elems = st.boundary_in, st.boundary_out
            elif kind in GEMM_KINDS:  # e.g. attention: the operands of its own matmuls
                node.in_elems, node.out_elems = st.gemm_in, st.gemm_out
            node.inputs_from = list(st.inputs_from)
        nodes[path] = node
    # Eligibility needs the GEMMs below each module.
    gemm_below: dict[str, int] = dict.fromkeys(nodes, 0)
    formats_below: dict[str, dict[str, int]] = {p: dict.fromkeys(GEMM_FORMATS, 0) for p in nodes}
    for node in nodes.values():
        if not node.is_gemm or node.path == "":
            continue
        ok = {f: node.is_leaf and format_reason(modules[node.path], node.kind, f) is None
              for f in GEMM_FORMATS}
        for anc in _ancestors(node.path):
            if anc in gemm_below:
                gemm_below[anc] += 1
                for f in GEMM_FORMATS:
                    formats_below[anc][f] += int(ok[f])
    for path, node in nodes.items():
        st = meas.stats.get(path)
        node.allowed, node.disallowed = eligibility(
            modules[path], node.kind, st.own_ops if st else (), gemm_below[path],
            formats_below[path])
    return nodes


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def _layout(model: nn.Module, nodes: dict[str, LayerNode]) -> GemmLayout:
    gemms = [n.path for n in nodes.values() if n.is_gemm and n.calls]
    inside: dict[str, list[str]] = {}
    for g in gemms:
        for anc in _ancestors(g) if g else []:
            inside.setdefault(anc, []).append(g)
    return GemmLayout(gemms=gemms, inside=inside)


def _data_flow(
    model: nn.Module,
    batch: Any,
    forward: Callable[[nn.Module, Any], Any],
    layout: GemmLayout,
    meas: Measurement,
    leaf_modules: Iterable[type | str] | None,
    tracers: Sequence[str],
    export_timeout: float | None,
) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """(tracer that produced the edges, edges, [(tracer, why it failed)])."""
    fallbacks: list[tuple[str, str]] = []
    for name in tracers:
        if name == "hooks":
            break
        try:
            if name == "fx":
                edges = fx_edges(model, batch, forward, layout, leaf_modules)
            else:
                edges = export_edges(model, batch, forward, layout, export_timeout)
        except TraceFailed as err:
            fallbacks.append((name, str(err)))
            continue
        return name, edges, fallbacks
    # Tensor identity on the real forward (measure.py): exact for the batch it ran on.
    gemm_set = set(layout.gemms)
    edges = [(a, b) for a, b in meas.edges if a in gemm_set and b in gemm_set]
    return "hooks", edges, fallbacks
