"""Why an attention module is not a fp8 choice, said once: the format lowers Linear
leaves, so a rule on the module reaches its eligible Linear layers (the old reason read
"Attention is not a Linear-like GEMM; a fp8 rule here lowers the Linear layers inside")."""

from __future__ import annotations

from torch import nn

from autoprec.probe.layers import select_layers
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file
from tests.helpers import MODELS

ENCODER = MODELS / "encoder4.py"


def test_attention_fp8_reason_counts_the_linear_layers_it_lowers() -> None:
    spec = load_model_file(ENCODER)
    model, batch = spec.model(), spec.calibration_batches()[0]
    graph = trace(model, batch, forward=spec.forward, tracers=("hooks",))
    rows = {r.path: r for r in select_layers(model, graph, ["bf16", "fp8", "mxfp8"])}
    attn = rows["blocks.0.attn"]
    assert "fp8" not in attn.precisions and "bf16" in attn.precisions
    why = attn.disallowed["fp8"]
    assert why == ("fp8 applies to Linear leaves: a fp8 rule on this Attention lowers its 2 "
                   "eligible Linear layers; its own matmuls stay in its region"), why
    assert "not a Linear-like" not in why
    assert "lowers its 2 eligible" in attn.disallowed["mxfp8"]
    assert "fp8" in rows["blocks.0.attn.qkv"].precisions  # the leaves it reaches take fp8


def test_a_container_with_no_eligible_linear_says_it_reaches_none() -> None:
    from autoprec.probe.layers import _container_reason

    inner = [nn.Linear(10, 10)]  # 10 is not a multiple of 16
    assert _container_reason("fp8", nn.Module(), inner) == (
        "fp8 applies to Linear leaves: a fp8 rule on this Module reaches no eligible Linear "
        "layer; its own matmuls stay in its region")
