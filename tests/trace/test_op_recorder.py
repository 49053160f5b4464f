"""The recorded program sees what autocast sees, inside ``torch.nn.functional``'s own
Python functions too (``trace.op_recorder``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.trace import trace
from autoprec.trace.op_recorder import record_ops
from tests import zoo


def _ops(graph):  # noqa: ANN001, ANN202
    return [(graph.ops.modules[op.module], op.name, op.kind) for op in graph.ops.ops
            if op.kind in ("gemm", "attention")]


def test_multihead_attention_runs_one_linear_per_projection_and_one_sdpa() -> None:
    """With torch.nn's fast path off (as apply runs it), ``F.multi_head_attention_forward``
    runs with function modes popped; its in-projection must still be one ``linear``
    (autocast casts its bias with it: a bias ``add`` in fp32 would promote the attention
    to fp32 in the replay) and its attention one SDPA."""
    case = zoo.mha()
    graph = trace(case.model, case.batch)
    assert _ops(graph) == [
        ("attn", "linear", "gemm"),  # the packed in-projection
        ("attn", "scaled_dot_product_attention", "attention"),
        ("attn", "linear", "gemm"),  # out_proj's weight, called by the functional forward
        ("fc", "linear", "gemm"), ("out", "linear", "gemm")]
    in_proj = next(op for op in graph.ops.ops if op.name == "linear")
    assert in_proj.recipe is not None and in_proj.recipe["f"] == "F.linear"
    assert graph.ops.values[in_proj.weight].param == "attn.in_proj_weight"
    sdpa = next(op for op in graph.ops.ops if op.kind == "attention")
    assert sdpa.flops > 0 and sdpa.recipe["f"] == "F.scaled_dot_product_attention"


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            self.attn(x, x, x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        raise RuntimeError("model failed")


def test_functional_globals_are_restored_also_when_the_forward_raises() -> None:
    linear = torch.nn.functional.linear
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="model failed"), torch.no_grad():
        record_ops(_Raises().eval(), torch.randn(2, 3, 8), lambda m, b: m(b), 2)
    assert torch.nn.functional.linear is linear
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
