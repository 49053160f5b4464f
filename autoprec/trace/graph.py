"""The layer graph: what the tracer knows about every module of a model.

A ``LayerNode`` is one module (by its ``named_modules()`` path). Numbers are per forward
pass of the example batch the graph was traced with (``LayerGraph.batch_size``
sequences/images); the cost model rescales activation terms to a deployment batch size.

Element counts, not bytes, are stored so that the cost model can price any precision.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autoprec.trace.ops import OpTrace

#: Op kinds a node may have. "gemm" kinds can be lowered by autocast / fp8.
KINDS = (
    "linear",  # nn.Linear and Linear-like (HF Conv1D)
    "conv",
    "attention",  # a module whose own code runs functional matmuls (SDPA, q @ k.T)
    "matmul",
    "embedding",
    "norm",
    "softmax",
    "activation",
    "elementwise",
    "dropout",
    "container",  # has children; its own code runs no GEMM
    "other",
)
GEMM_KINDS = ("linear", "conv", "attention", "matmul")


@dataclass
class LayerNode:
    """One module of the model, measured on one real forward."""

    path: str  # module path, "" is the root
    module_type: str  # class name, e.g. "Linear", "BertSelfAttention"
    kind: str  # one of KINDS
    is_leaf: bool  # has no child modules
    depth: int
    input_shapes: list[list[int]] = field(default_factory=list)  # floating tensor inputs
    output_shapes: list[list[int]] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    params: int = 0  # parameters owned directly by this module (not children)
    calls: int = 0  # times forward ran in one pass
    # FLOPs of ops executed by this module's own code (children excluded), all calls.
    flops: int = 0
    # FLOPs including children (what FlopCounterMode reports per module).
    total_flops: int = 0
    # Element counts moved by this module's own compute, all calls.
    weight_elems: int = 0  # parameters read (read once per call)
    in_elems: int = 0  # floating input activations read
    out_elems: int = 0  # floating output activations written
    # Precisions this module may take, and for each it may not, the reason.
    allowed: list[str] = field(default_factory=list)
    disallowed: dict[str, str] = field(default_factory=dict)
    # Producers of this node's inputs (module paths of GEMM-bearing nodes), when known.
    inputs_from: list[str] = field(default_factory=list)

    @property
    def is_gemm(self) -> bool:
        """Runs a matmul/conv in its own code (autocast/fp8-lowerable work)."""
        return self.kind in GEMM_KINDS

    @property
    def bytes_fp32(self) -> int:
        """Bytes moved per pass if everything is fp32."""
        return 4 * (self.weight_elems + self.in_elems + self.out_elems)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerGraph:
    """Every module of a model, in execution order (first call), plus how it was traced."""

    nodes: dict[str, LayerNode]
    tracer: str  # "fx", "export" or "hooks": what produced the data-flow edges
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (tracer, why it failed)
    fingerprint: str = ""
    batch_size: int = 1
    model_name: str = ""
    # Data-flow edges between GEMM-bearing nodes: (producer path, consumer path).
    edges: list[tuple[str, str]] = field(default_factory=list)
    # Every op of one forward (trace/ops.py): what the cost model re-prices under a plan.
    ops: OpTrace | None = None

    def __iter__(self) -> Iterator[LayerNode]:
        return iter(self.nodes.values())

    def __getitem__(self, path: str) -> LayerNode:
        return self.nodes[path]

    def __contains__(self, path: object) -> bool:
        return path in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def gemm_nodes(self) -> list[LayerNode]:
        """Nodes whose own code runs a matmul/conv, in execution order."""
        return [n for n in self.nodes.values() if n.is_gemm and n.calls > 0]

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes.values())

    def to_frame(self):  # -> pandas.DataFrame (imported lazily: pandas is for the boundary)
        import pandas as pd

        rows = []
        for n in self.nodes.values():
            rows.append(
                {
                    "layer": n.path or "<root>",
                    "type": n.module_type,
                    "kind": n.kind,
                    "in_shape": "; ".join("x".join(map(str, s)) for s in n.input_shapes),
                    "out_shape": "; ".join("x".join(map(str, s)) for s in n.output_shapes),
                    "params": n.params,
                    "calls": n.calls,
                    "flops": n.flops,
                    "bytes": n.bytes_fp32,
                    "allowed": ",".join(n.allowed),
                    "why_not": "; ".join(f"{k}: {v}" for k, v in n.disallowed.items()),
                }
            )
        return pd.DataFrame(rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "tracer": self.tracer,
            "fallbacks": [{"tracer": t, "reason": r} for t, r in self.fallbacks],
            "fingerprint": self.fingerprint,
            "batch_size": self.batch_size,
            "total_flops": self.total_flops,
            "edges": [list(e) for e in self.edges],
            "layers": [n.to_dict() for n in self.nodes.values()],
        }


def fingerprint(model: torch.nn.Module) -> str:
    """Structure hash: module paths, types and parameter shapes (not values).

    Wrapper prefixes (``_orig_mod.`` from torch.compile, ``module.`` from DDP) are removed
    so a compiled or wrapped model has the fingerprint of the model it wraps.
    """
    from autoprec.io.paths import unwrap_model

    model = unwrap_model(model)
    items = []
    for name, mod in model.named_modules():
        params = [
            (pname, list(p.shape)) for pname, p in mod.named_parameters(recurse=False)
        ]
        items.append((name, type(mod).__name__, params))
    blob = json.dumps(items, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
