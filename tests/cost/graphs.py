"""Hand-built LayerGraphs and a round-number profile for the cost tests."""

from __future__ import annotations

from collections.abc import Sequence

from autoprec.cost.profiles import DeviceProfile
from autoprec.trace.graph import LayerGraph, LayerNode

# Round numbers so that expected times can be worked out by hand.
TOY = DeviceProfile(
    name="toy", description="toy", source="tests",
    peak_flops={"fp32": 1e12, "tf32": 2e12, "bf16": 4e12, "fp16": 4e12, "fp8": 8e12},
    memory_bw=1e11, launch_overhead_s=1e-6,
)


def lin(path: str, m: int, k: int, n: int, calls: int = 1,
        inputs_from: Sequence[str] = ()) -> LayerNode:
    """A Linear on (m, k) @ (k, n) per call (no bias in the element counts)."""
    return LayerNode(path=path, module_type="Linear", kind="linear", is_leaf=True, depth=1,
                     calls=calls, flops=2 * m * k * n * calls, weight_elems=k * n * calls,
                     in_elems=m * k * calls, out_elems=m * n * calls,
                     inputs_from=list(inputs_from))


def other(path: str, kind: str, elems: int, weight: int = 0, flops: int = 0,
          inputs_from: Sequence[str] = (), is_leaf: bool = True) -> LayerNode:
    return LayerNode(path=path, module_type=kind.title(), kind=kind, is_leaf=is_leaf, depth=1,
                     calls=1, flops=flops, weight_elems=weight, in_elems=elems,
                     out_elems=elems, inputs_from=list(inputs_from))


def graph(*nodes: LayerNode, edges: Sequence[tuple[str, str]] = (),
          batch_size: int = 1) -> LayerGraph:
    return LayerGraph(nodes={n.path: n for n in nodes}, tracer="manual",
                      batch_size=batch_size, edges=list(edges), model_name="toy")


def chain(n_layers: int, m: int, d: int, with_norms: bool = False) -> LayerGraph:
    """fc0 -> [ln0 ->] fc1 -> ... data flow recorded in edges (like a traced MLP)."""
    nodes: list[LayerNode] = []
    edges = []
    for i in range(n_layers):
        prev = f"fc{i - 1}" if i else None
        nodes.append(lin(f"fc{i}", m, d, d, inputs_from=[prev] if prev else []))
        if prev:
            edges.append((prev, f"fc{i}"))
        if with_norms:
            nodes.append(other(f"ln{i}", "norm", m * d, weight=2 * d, inputs_from=[f"fc{i}"]))
    return graph(*nodes, edges=edges)
