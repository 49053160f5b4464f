"""A meta-device model traced shape-only prices exactly as the same model with real weights."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import StepPart
from autoprec.measure import record_loss
from autoprec.policy import Policy
from autoprec.trace import trace
from autoprec.trace.shape_only import ShadowMode, ShapeOnlyError, on_meta, shadowed, trace_shapes

transformers = pytest.importorskip("transformers")


def _config(layers: int = 2) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=64, use_cache=False)


def _forward(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids).logits


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                             ids[:, 1:].flatten())


@pytest.fixture(scope="module")
def graphs() -> tuple:
    torch.manual_seed(0)
    cfg = _config()
    real = transformers.LlamaForCausalLM(cfg).eval()
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg).eval()
    assert on_meta(meta) and not on_meta(real)
    ids = torch.randint(0, cfg.vocab_size, (1, 32))
    g_real = trace(real, ids, forward=_forward, tracers=("hooks",))
    g_meta = trace_shapes(meta, ids, forward=_forward)
    loss_real = record_loss(real, _forward, _loss, ids)
    with shadowed():
        loss_meta = record_loss(meta, _forward, _loss, ids)
    return g_real, g_meta, loss_real, loss_meta


def test_same_graph_as_real_weights(graphs: tuple) -> None:
    g_real, g_meta, *_ = graphs
    assert g_meta.fingerprint == g_real.fingerprint
    assert list(g_meta.nodes) == list(g_real.nodes)
    for path, node in g_real.nodes.items():
        assert g_meta.nodes[path].__dict__ == node.__dict__, path
    assert g_meta.edges == g_real.edges
    ops = [(o.name, o.kind, o.module, o.inputs, o.outputs, o.flops, o.fixed_dtype)
           for o in g_real.ops.ops]
    assert [(o.name, o.kind, o.module, o.inputs, o.outputs, o.flops, o.fixed_dtype)
            for o in g_meta.ops.ops] == ops
    assert [v.__dict__ for v in g_meta.ops.values] == [v.__dict__ for v in g_real.ops.values]


@pytest.mark.parametrize("device", ["h100", "b200"])
def test_prices_exactly_like_real_weights(graphs: tuple, device: str) -> None:
    g_real, g_meta, loss_real, loss_meta = graphs
    assert loss_meta.numel == loss_real.numel
    assert loss_meta.kernels == loss_real.kernels
    assert loss_meta.saved == loss_real.saved
    fp8 = [p for p, n in g_real.nodes.items() if n.is_leaf and "fp8" in n.allowed]
    plans = [Policy(default="fp32"), Policy(default="bf16"),
             Policy(default="bf16", layers=dict.fromkeys(fp8, "fp8")),
             Policy(default="bf16", layers=dict.fromkeys(fp8, "bf16"), form="deploy")]
    if device == "b200":
        plans.append(Policy(default="bf16", layers=dict.fromkeys(fp8, "mxfp8")))
    for step in (False, True):
        costs = []
        for g, loss in ((g_real, loss_real), (g_meta, loss_meta)):
            c = CostModel(g, get_profile(device), 8, step=StepPart() if step else None)
            if step:
                c.step.set_loss(c, loss)
            costs.append(c)
        for pol in plans:
            a, b = (c.estimate(pol) for c in costs)
            assert a == b or (math.isinf(a) and math.isinf(b)), (device, step, pol)
            assert a > 0


def test_a_value_from_the_weights_is_refused() -> None:
    with torch.device("meta"):
        lin = torch.nn.Linear(4, 4)
    with ShadowMode(), pytest.raises(ShapeOnlyError, match="computed from the model's weights"):
        lin(torch.ones(2, 4)).sum().item()


def test_known_values_take_the_real_branch() -> None:
    ids = torch.arange(6).reshape(1, 6)
    with ShadowMode():
        pos = torch.arange(6, device="meta")[None]
        assert pos.device.type == "meta"
        assert bool((pos[:, -1] == 5).all())  # read from the real copy
        assert (ids.to("meta") + pos).nonzero().shape == (5, 2)
