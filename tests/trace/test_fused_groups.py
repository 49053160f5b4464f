"""Fused groups found by names (vLLM's packed modules, an MoE layer's experts) and by the
graph (GEMM leaves that read the very same input tensor)."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.trace.fused_groups import fused_groups, groups_by_input, mixed_groups
from tests.zoo import bert, llama


def _members(groups) -> set[tuple[str, ...]]:
    return {g.members for g in groups}


def test_llama_qkv_and_gate_up_by_name_and_by_input() -> None:
    case = llama()
    by_name = fused_groups(case.model)
    want = set()
    for i in range(2):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        want |= {(f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                 (f"{m}.gate_proj", f"{m}.up_proj")}
    assert _members(by_name) == want
    graph = groups_by_input(case.model, lambda: case.model(**case.batch))
    assert _members(graph) == want  # the same groups, found from the forward alone
    assert _members(fused_groups(case.model, lambda: case.model(**case.batch))) == want


def test_bert_query_key_value() -> None:
    case = bert()
    groups = fused_groups(case.model, lambda: case.model(**case.batch))
    a = "encoder.layer.{}.attention.self"
    assert _members(groups) == {tuple(f"{a.format(i)}.{n}" for n in ("query", "key", "value"))
                                for i in range(2)}


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
                                     for _ in range(2))
        self.head_a, self.head_b = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 32)
        w = self.router(x).softmax(-1)  # (B, 2)
        y = sum(w[:, i:i + 1] * e(x) for i, e in enumerate(self.experts))
        return self.head_a(y) + self.head_b(y)  # two unrelated names, one input


def test_experts_by_name_and_a_shared_input_by_the_graph() -> None:
    model = _Experts().eval()
    x = torch.randn(4, 32)
    groups = fused_groups(model, lambda: model(x))
    experts = ("experts.0.0", "experts.0.1", "experts.1.0", "experts.1.1")
    # the router reads x too, as do the experts' first Linears: one group by the graph,
    # merged with the experts' group by name
    assert ("router", *experts) in _members(groups)
    assert ("head_a", "head_b") in _members(groups)
    # without a forward only the names speak
    assert _members(fused_groups(model)) == {experts}


def test_mixed_groups_names_the_members() -> None:
    case = llama()
    groups = fused_groups(case.model)
    prec = {"layers.0.self_attn.q_proj": "fp8"}
    (bad,) = mixed_groups(groups, lambda p: prec.get(p, "bf16"))
    assert bad[0].kind == "qkv" and bad[1]["layers.0.self_attn.k_proj"] == "bf16"
