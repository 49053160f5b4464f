"""Fused groups: GEMM layers a serving runtime runs as one GEMM, so they share one precision.

vLLM (and TensorRT-LLM, SGLang) load a checkpoint's q/k/v projections into one
``qkv_proj`` and an MLP's gate/up projections into one ``gate_up_proj`` (vLLM's
``packed_modules_mapping``: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj":
["gate_proj", "up_proj"]}``; BERT's ``query``/``key``/``value`` the same way), and an MoE
layer's experts into one fused-MoE kernel. One GEMM runs one scheme: a checkpoint whose
fused group mixes schemes is refused at load or loads with one scheme for all (vLLM PR
#17829, llm-compressor #2730). A plan meant for such a runtime decides each group as one.

Two ways find a group, and their groups are merged:

- **names** (``groups_by_name``): sibling leaves named like a fused family (the table
  ``FAMILIES``), and every GEMM leaf under a module named ``experts`` (one group per MoE
  layer);
- **the graph** (``groups_by_input``): one real forward with a hook on every GEMM leaf;
  leaves called on the very same input tensor (the same object, or the same storage,
  shape and strides) read one activation and can be one GEMM — q/k/v after a norm,
  gate/up, an encoder's k/v in cross-attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.formats.gemm import is_gemm_module

#: Sibling names a fused runtime packs into one GEMM (vLLM's packed_modules_mapping and
#: stacked_params_mapping for Llama/Mistral/Qwen, BERT, Mixtral's expert w1/w3).
FAMILIES: dict[str, frozenset[str]] = {
    "qkv": frozenset({"q_proj", "k_proj", "v_proj"}),
    "qkv_bert": frozenset({"query", "key", "value"}),
    "qkv_short": frozenset({"wq", "wk", "wv"}),
    "gate_up": frozenset({"gate_proj", "up_proj"}),
    "gate_up_w13": frozenset({"w1", "w3"}),
}
#: A module with this name holds an MoE layer's experts.
EXPERTS = "experts"


@dataclass(frozen=True)
class FusedGroup:
    """GEMM leaves that run as one GEMM (``members`` in model order), and why (``kind``:
    a ``FAMILIES`` key, ``"experts"`` or ``"same_input"``)."""

    kind: str
    members: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.kind} group ({', '.join(self.members)})"


def _gemm_leaves(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {p: m for p, m in model.named_modules()
            if p and is_gemm_module(m) and not any(True for _ in m.children())}


def groups_by_name(model: torch.nn.Module) -> list[FusedGroup]:
    """The fused groups named like vLLM's packed modules, and one per ``experts`` module."""
    leaves = _gemm_leaves(model)
    groups: list[FusedGroup] = []
    by_parent: dict[str, dict[str, str]] = {}
    for path in leaves:
        parent, _, name = path.rpartition(".")
        by_parent.setdefault(parent, {})[name] = path
    for children in by_parent.values():
        for kind, family in FAMILIES.items():
            found = [children[n] for n in children if n in family]
            if len(found) >= 2:
                groups.append(FusedGroup(kind, tuple(found)))
    for path, _ in model.named_modules():
        if path.rpartition(".")[2] == EXPERTS:
            inside = tuple(p for p in leaves if p.startswith(path + "."))
            if len(inside) >= 2:
                groups.append(FusedGroup(EXPERTS, inside))
    return groups


def groups_by_input(model: torch.nn.Module, run: Callable[[], Any]) -> list[FusedGroup]:
    """GEMM leaves that read the same input tensor in one forward (``run()`` calls the
    model once; hooks only: nothing is changed)."""
    leaves = _gemm_leaves(model)
    seen: dict[tuple[Any, ...], list[str]] = {}
    alive: list[torch.Tensor] = []  # held, so no freed storage is reused by a later input
    handles = []

    def hook(path: str) -> Callable[..., None]:
        def record(_m: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            try:
                key: tuple[Any, ...] = (x.untyped_storage().data_ptr(), x.storage_offset(),
                                        tuple(x.shape), tuple(x.stride()), x.dtype)
            except (RuntimeError, NotImplementedError):
                key = (id(x),)
            alive.append(x)
            users = seen.setdefault(key, [])
            if path not in users:
                users.append(path)
        return record

    try:
        for path, mod in leaves.items():
            handles.append(mod.register_forward_pre_hook(hook(path)))
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    order = {p: i for i, p in enumerate(leaves)}
    return [FusedGroup("same_input", tuple(sorted(users, key=order.__getitem__)))
            for users in seen.values() if len(users) >= 2]


def merge_groups(groups: Iterable[FusedGroup], order: Sequence[str]) -> list[FusedGroup]:
    """Overlapping groups joined into one (union-find); members in ``order``'s order. A
    merged group keeps the first kind found (names before the graph)."""
    parent: dict[str, str] = {}
    kind_of: dict[str, str] = {}

    def find(p: str) -> str:
        while parent.setdefault(p, p) != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    for g in groups:
        root = find(g.members[0])
        kind_of.setdefault(root, g.kind)
        for m in g.members[1:]:
            r = find(m)
            if r != root:
                parent[r] = root
                kind_of.setdefault(root, kind_of.get(r, g.kind))
    rank = {p: i for i, p in enumerate(order)}
    members: dict[str, list[str]] = {}
    for p in parent:
        members.setdefault(find(p), []).append(p)
    out = []
    for root, ms in members.items():
        if len(ms) >= 2:
            ms.sort(key=lambda p: rank.get(p, len(rank)))
            out.append(FusedGroup(kind_of.get(root, "same_input"), tuple(ms)))
    out.sort(key=lambda g: rank.get(g.members[0], len(rank)))
    return out


def fused_groups(model: torch.nn.Module, run: Callable[[], Any] | None = None
                 ) -> list[FusedGroup]:
    """Every fused group of ``model``: by names, and by the graph when ``run`` (one forward
    of the model) is given; overlapping groups merged."""
    groups = groups_by_name(model)
    if run is not None:
        groups += groups_by_input(model, run)
    return merge_groups(groups, list(_gemm_leaves(model)))


def mixed_groups(groups: Iterable[FusedGroup], precision_of: Callable[[str], str]
                 ) -> list[tuple[FusedGroup, dict[str, str]]]:
    """The groups whose members do not share one precision, with each member's."""
    out = []
    for g in groups:
        precs = {m: precision_of(m) for m in g.members}
        if len(set(precs.values())) > 1:
            out.append((g, precs))
    return out


__all__ = ["EXPERTS", "FAMILIES", "FusedGroup", "fused_groups", "groups_by_input",
           "groups_by_name", "merge_groups", "mixed_groups"]
