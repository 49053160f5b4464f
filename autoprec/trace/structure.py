"""Data flow between GEMM-bearing modules, from a graph: fx first, then torch.export.

Both tracers see the user's ``forward(model, batch)`` through a small wrapper module whose
inputs are the batch's tensors (non-tensor leaves stay constants). Each graph op is mapped
to the module whose code ran it (fx ``call_module`` targets; the innermost entry of the
``nn_module_stack`` metadata that fx and export record), then producers are propagated
along the graph exactly as ``measure`` does on real tensors: through non-GEMM ops, and
reset at every GEMM op. The third tracer, tensor identity on the real forward, lives in
``measure.py`` and always works.

A graph that lacks a GEMM layer the real forward ran (a module bypassing ``__call__``, a
branch hidden in a higher-order op) is rejected, so the next tracer gets a chance.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoprec.trace.kinds import GEMM_OPS
from autoprec.workload.metrics import iter_floats

_ROOT = "model"  # attribute name of the user's model inside the wrapper


class TraceFailed(Exception):
    """A graph tracer could not produce the data flow; the message is one line."""


@dataclass
class GemmLayout:
    """What the measured forward says about GEMM-bearing modules."""

    gemms: Sequence[str]  # GEMM-bearing module paths that ran, in first-call order
    inside: dict[str, list[str]]  # module path -> GEMM paths among its descendants (ordered)


def one_line(err: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (shortened) for ``graph.fallbacks``."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    if len(text) > limit and ". " in text[:limit]:  # keep whole sentences when they fit
        return text[: text.rindex(". ", 0, limit) + 1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _BatchModule(nn.Module):
    """``forward(*tensors)`` rebuilds the batch and calls the user's ``forward(model, batch)``.

    ``floats_only`` flattens the outputs to their floating tensors (what the error metric
    reads), so a KV-cache object or ModelOutput never has to be exportable.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        forward: Callable[[nn.Module, Any], Any],
        floats_only: bool,
    ) -> None:
        super().__init__()
        self.model = model  # registered as a child: paths inside are "model.<path>"
        leaves, self._spec = pytree.tree_flatten(batch)
        self._leaves = leaves
        self._slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self._user_forward = forward
        self._floats_only = floats_only

    def example_args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._leaves[i] for i in self._slots)

    def forward(self, *tensors: Any) -> Any:
        leaves = list(self._leaves)
        for j, i in enumerate(self._slots):
            leaves[i] = tensors[j]
        out = self._user_forward(self.model, pytree.tree_unflatten(leaves, self._spec))
        return tuple(iter_floats(out)) if self._floats_only else out


def _user_path(qualname: str) -> str | None:
    """Wrapper path -> user module path: ``model.encoder.0@1`` -> ``encoder.0``; None outside."""
    qualname = re.sub(r"@\d+$", "", qualname)
    if qualname == _ROOT:
        return ""
    if qualname.startswith(_ROOT + "."):
        return qualname[len(_ROOT) + 1 :]
    return None


def _innermost(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    value = list(stack.values())[-1]
    return _user_path(str(value[0] if isinstance(value, tuple) else value))


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    target = getattr(node.target, "_overloadpacket", node.target)  # aten OpOverload
    return getattr(target, "__name__", str(target))


def _propagate(graph: fx.Graph, layout: GemmLayout, tracer: str) -> list[tuple[str, str]]:
    """Edges (producer, consumer) between GEMM-bearing modules along ``graph``."""
    gemm_set = set(layout.gemms)
    producers: dict[fx.Node, frozenset[str]] = {}
    edges: dict[tuple[str, str], None] = {}
    covered: set[str] = set()

    def link(srcs: Iterable[str], dst: str) -> None:
        for p in sorted(srcs):
            if p != dst:
                edges[(p, dst)] = None

    for node in graph.nodes:
        srcs = frozenset().union(*(producers.get(i, frozenset()) for i in node.all_input_nodes))
        made = srcs
        if node.op == "call_module":
            path = _user_path(str(node.target))
            inner = layout.inside.get(path or "", []) if path is not None else []
            if path in gemm_set:
                link(srcs, path)
                covered.add(path)
                covered.update(inner)
                made = frozenset((path,))
            elif inner:
                # A black-box leaf (``leaf_modules``) with GEMMs inside: its inputs feed the
                # first GEMM that ran in it, its output comes from the last one.
                link(srcs, inner[0])
                covered.update(inner)
                made = frozenset((inner[-1],))
        elif node.op in ("call_function", "call_method") and _op_name(node) in GEMM_OPS:
            owner = _innermost(node)
            if owner in gemm_set:
                link(srcs, owner)
                covered.add(owner)
                made = frozenset((owner,))
        producers[node] = made
    missing = [p for p in layout.gemms if p not in covered]
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        )
        raise TraceFailed(f"{tracer} graph lacks GEMM layers the forward ran: {shown}")
    return list(edges)


class _LeafTracer(fx.Tracer):
    """fx tracer that goes inside every module with children unless told it is a leaf."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        path = _user_path(module_qualified_name)
        if isinstance(m, self.leaf_types) or (path is not None and path in self.leaf_paths):
            return True
        # torch.nn modules without children (Linear, LayerNorm...) are leaves; containers,
        # torch.nn ones included (TransformerEncoderLayer), are traced into.
        return not any(True for _ in m.children()) and path != ""


def fx_edges(
    model: nn.Module,
    batch: Any,
    forward: Callable[[nn.Module, Any], Any],
    layout: GemmLayout,
    leaf_modules: Iterable[type | str] | None = None,
) -> list[tuple[str, str]]:
    """Data-flow edges from ``torch.fx`` symbolic tracing; TraceFailed when fx cannot."""
    leaves = list(leaf_modules or ())
    tracer = _LeafTracer(
        tuple(x for x in leaves if isinstance(x, type)),
        frozenset(x for x in leaves if isinstance(x, str)),
    )
    try:
        graph = tracer.trace(_BatchModule(model, batch, forward, floats_only=False))
    except Exception as err:  # fx raises anything the model's Python does with a Proxy
        raise TraceFailed(one_line(err)) from err
    return _propagate(graph, layout, "fx")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """A failing export logs warnings and prints its partial graph to stderr
    (torch/export/_trace.py, ``_log_export_wrapper``); the fallback keeps one line."""
    names = ["torch", *[n for n in logging.root.manager.loggerDict if n.startswith("torch")]]
    saved = {n: logging.getLogger(n).level for n in names}
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


@contextlib.contextmanager
def _time_limit(seconds: float | None, fired: list[bool]) -> Iterator[None]:
    """SIGALRM after ``seconds`` (main thread on POSIX only; otherwise unguarded).

    An outer timer (pytest-timeout uses SIGALRM too) that would fire first is left alone;
    otherwise it is restored, less the time spent here.
    """
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return
    assert seconds is not None

    def _fire(signum: int, frame: Any) -> None:
        fired.append(True)
        raise TimeoutError(f"gave up after {seconds:g} s")

    old_handler = signal.signal(signal.SIGALRM, _fire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    if old_delay and old_delay <= seconds:  # the outer alarm comes first: let it
        signal.setitimer(signal.ITIMER_REAL, old_delay, old_interval)
        signal.signal(signal.SIGALRM, old_handler)
        yield
        return
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def export_edges(
    model: nn.Module,
    batch: Any,
    forward: Callable[[nn.Module, Any], Any],
    layout: GemmLayout,
    timeout: float | None = 60.0,
) -> list[tuple[str, str]]:
    """Data-flow edges from ``torch.export.export(strict=False)``; TraceFailed when it cannot.

    Non-strict export runs the model's Python on fake tensors, so what stops it is
    data-dependent control flow; ``timeout`` bounds its time on large models.
    """
    wrapper = _BatchModule(model, batch, forward, floats_only=True)
    fired: list[bool] = []
    try:
        with _quiet_torch_logs(), _time_limit(timeout, fired):
            program = torch.export.export(wrapper, wrapper.example_args(), strict=False)
    except Exception as err:  # export raises many types (user errors, guards, unsupported)
        if fired:
            raise TraceFailed(f"gave up after {timeout:g} s (export_timeout)") from err
        raise TraceFailed(one_line(err)) from err
    return _propagate(program.graph, layout, "export")
