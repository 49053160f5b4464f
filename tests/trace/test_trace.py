"""trace() on the zoo: FLOPs against hand counts, kinds, eligibility, tracers and fallbacks.

Hand counts (torch's FlopCounterMode convention: 2 FLOPs per multiply-add, bias and
pointwise ops not counted, attention counted dense even when masked):
- Linear / Conv1D:  2 * tokens * in * out                      (tokens = B*T)
- attention:        2 * B*H*Tq*Tk*d (q @ k.T) + 2 * B*H*Tq*Tk*d (probs @ v)
- Conv2d:           2 * B * C_out * H_out * W_out * C_in * kh * kw
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autoprec.trace import LayerGraph, trace
from tests import zoo


@functools.cache
def traced(name: str) -> tuple[zoo.Case, LayerGraph]:
    case = zoo.ALL[name]()
    return case, trace(case.model, case.batch, model_name=name)


def linear(tokens: int, i: int, o: int) -> int:
    return 2 * tokens * i * o


def attention(b: int, h: int, tq: int, tk: int, d: int) -> int:
    return 2 * (2 * b * h * tq * tk * d)


def linear_like(model: nn.Module) -> set[str]:
    """Paths of every nn.Linear / HF Conv1D in the model."""
    return {
        p
        for p, m in model.named_modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    }


def check_every_linear(
    case: zoo.Case, graph: LayerGraph, tokens: int, special: dict[str, int] | None = None
) -> None:
    """Every Linear-like module is a node of kind linear with 2*tokens*in*out FLOPs
    (``special``: paths that see another token count, e.g. BERT's pooler: [CLS] only)."""
    for path in linear_like(case.model):
        node, mod = graph[path], case.model.get_submodule(path)
        w = mod.weight
        i, o = (w.shape[1], w.shape[0]) if isinstance(mod, nn.Linear) else tuple(w.shape)
        n = (special or {}).get(path, tokens)
        assert node.kind == "linear", path
        assert node.flops == node.total_flops == node.calls * linear(n, i, o), path


# ---------------------------------------------------------------- plain models (fx works)


def test_mlp_fx_kinds_flops_and_reasons() -> None:
    case, g = traced("mlp")
    B = case.dims["B"]
    assert g.tracer == "fx" and g.fallbacks == []
    assert [n.path for n in g.gemm_nodes] == ["fc1", "fc2", "head"]
    check_every_linear(case, g, B)
    assert g.total_flops == linear(B, 100, 64) + linear(B, 64, 32) + linear(B, 32, 10)
    assert g[""].total_flops == g.total_flops and g[""].flops == 0
    assert {n.path: n.kind for n in g} == {
        "": "container", "fc1": "linear", "act": "activation", "norm": "norm",
        "fc2": "linear", "drop": "dropout", "head": "linear",
    }  # fmt: skip
    # fp8 only for Linear leaves with both dims multiples of 16.
    assert g["fc1"].disallowed["fp8"] == "in_features 100 not a multiple of 16"
    assert "block size 32" in g["fc1"].disallowed["mxfp8"]
    assert g["head"].disallowed["fp8"] == "out_features 10 not a multiple of 16"
    assert g["fc2"].allowed == ["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]
    assert g[""].allowed == ["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]  # via fc2
    norm = g["norm"]
    assert norm.allowed == ["fp32"]
    assert (
        norm.disallowed["bf16"]
        == "no autocast-eligible op (layer_norm runs in fp32 under autocast)"
    )
    assert norm.disallowed["fp8"] == "not a GEMM"
    # Shapes, dtypes, element counts per pass.
    fc1 = g["fc1"]
    assert fc1.input_shapes == [[B, 100]] and fc1.output_shapes == [[B, 64]]
    assert fc1.input_dtypes == ["float32"] and fc1.output_dtypes == ["float32"]
    assert fc1.params == 100 * 64 + 64 == fc1.weight_elems
    assert (fc1.in_elems, fc1.out_elems) == (B * 100, B * 64)
    assert fc1.bytes_fp32 == 4 * (fc1.params + B * 100 + B * 64)
    assert g.edges == [("fc1", "fc2"), ("fc2", "head")]
    assert g["fc2"].inputs_from == ["fc1"] and g["norm"].inputs_from == ["fc1"]
    assert g.batch_size == B and g.model_name == "mlp"
    assert g.fingerprint.startswith("sha256:")


def test_shared_module_called_twice_and_tied_weights() -> None:
    case, g = traced("shared")
    B, T, C, V = (case.dims[k] for k in "BTCV")
    assert g.tracer == "fx"
    block = g["block"]
    assert block.calls == 2
    assert block.flops == 2 * linear(B * T, C, C)  # doubled: both calls
    assert block.weight_elems == 2 * block.params
    assert g["head"].flops == linear(B * T, C, V)
    assert g["head"].params == g["emb"].params == V * C  # the tied weight, seen by both
    assert g.edges == [("block", "head")]  # block -> block is the same precision: no edge


def test_cnn_conv_flops() -> None:
    case, g = traced("cnn")
    B = case.dims["B"]
    conv1 = 2 * B * 8 * 16 * 16 * 3 * 3 * 3  # (B, 3, 16, 16) -> (B, 8, 16, 16), 3x3
    conv2 = 2 * B * 16 * 6 * 6 * 8 * 3 * 3  # (B, 8, 8, 8) -> (B, 16, 6, 6), 3x3
    assert g.tracer == "fx"
    assert (g["conv1"].kind, g["conv1"].flops) == ("conv", conv1)
    assert (g["conv2"].kind, g["conv2"].flops) == ("conv", conv2)
    assert g["conv1"].output_shapes == [[B, 8, 16, 16]]
    assert g["fc"].flops == linear(B, 576, 16)
    assert g.total_flops == conv1 + conv2 + linear(B, 576, 16)
    assert g["conv1"].disallowed["fp8"].startswith("conv is not Linear-like")
    assert g["bn"].kind == "norm" and g["pool"].kind == "other"
    assert g.edges == [("conv1", "conv2"), ("conv2", "fc")]


def test_data_dependent_control_flow_falls_back_to_hooks() -> None:
    case, g = traced("branchy")
    B = case.dims["B"]
    assert g.tracer == "hooks"
    reasons = dict(g.fallbacks)
    assert list(reasons) == ["fx", "export"]
    assert "control flow" in reasons["fx"]
    assert "data-dependent" in reasons["export"]
    assert all("\n" not in r for r in reasons.values())
    assert g["neg"].calls == 0 and g["neg"].flops == 0  # the branch not taken
    assert g.total_flops == linear(B, 32, 32) * 2 + linear(B, 32, 8)
    assert g.edges == [("inp", "pos"), ("pos", "out")]


def test_user_leaf_modules_in_fx() -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
    model.add_module("head", nn.Linear(16, 4))
    g = trace(model, torch.randn(2, 16), leaf_modules=["body"])
    assert g.tracer == "fx"
    # A black-box leaf: data enters its first GEMM and leaves from its last.
    assert g.edges == [("body.2", "head")]
    assert g["body.0"].flops == linear(2, 16, 16)  # measured all the same
    g2 = trace(model, torch.randn(2, 16))
    assert g2.edges == [("body.0", "body.2"), ("body.2", "head")]


# ---------------------------------------------------------------- HuggingFace (fx fails)


def test_bert() -> None:
    case, g = traced("bert")
    B, T, C, H, F, L = (case.dims[k] for k in "BTCHFL")
    d = C // H
    assert g.tracer == "export"
    assert [t for t, _ in g.fallbacks] == ["fx"]
    check_every_linear(case, g, B * T, {"pooler.dense": B})
    for i in range(L):
        att = g[f"encoder.layer.{i}.attention.self"]
        assert att.kind == "attention" and not att.is_leaf
        assert att.flops == attention(B, H, T, T, d)  # SDPA: own code, seen via dispatch
        assert att.total_flops == att.flops + 3 * linear(B * T, C, C)
    per_layer = 4 * linear(B * T, C, C) + 2 * linear(B * T, C, F) + attention(B, H, T, T, d)
    pooler = linear(B, C, C)  # [CLS] token only
    assert g.total_flops == L * per_layer + pooler == g[""].total_flops
    p = "encoder.layer.0.attention"
    for src in ("query", "key", "value"):
        assert (f"{p}.self.{src}", f"{p}.self") in g.edges
    assert (f"{p}.self", f"{p}.output.dense") in g.edges
    assert g[f"{p}.self"].inputs_from == [f"{p}.self.key", f"{p}.self.query", f"{p}.self.value"]
    assert g["embeddings.LayerNorm"].allowed == ["fp32"]
    assert g["embeddings"].kind == "container" and g["embeddings"].allowed == ["fp32"]
    assert g["encoder"].allowed == ["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]


def test_gpt2_conv1d_and_tied_lm_head() -> None:
    case, g = traced("gpt2")
    B, T, C, H, L, V = (case.dims[k] for k in "BTCHLV")
    assert g.tracer == "export"
    check_every_linear(case, g, B * T)
    assert g["transformer.h.0.attn.c_attn"].module_type == "Conv1D"
    assert g["transformer.h.0.attn.c_attn"].flops == linear(B * T, C, 3 * C)
    assert g["transformer.h.0.attn"].flops == attention(B, H, T, T, C // H)
    assert g["lm_head"].disallowed["fp8"] == "out_features 100 not a multiple of 16"
    per_layer = (
        linear(B * T, C, 3 * C) + linear(B * T, C, C) + 2 * linear(B * T, C, 4 * C)
        + attention(B, H, T, T, C // H)
    )  # fmt: skip
    assert g.total_flops == L * per_layer + linear(B * T, C, V)


def test_gpt2_with_cache_exports() -> None:
    """use_cache=True returns a cache object; the tracer keeps only floating outputs."""
    case = zoo.gpt2()
    case.model.config.use_cache = True
    g = trace(case.model, case.batch)
    assert g.tracer == "export"


def test_llama_grouped_query_attention() -> None:
    case, g = traced("llama")
    B, T, C, H, KV, F, L = (case.dims[k] for k in ("B", "T", "C", "H", "KV", "F", "L"))
    d = C // H
    assert g.tracer == "export"
    check_every_linear(case, g, B * T)
    assert g["layers.0.self_attn.k_proj"].flops == linear(B * T, C, KV * d)
    assert g["layers.0.self_attn"].kind == "attention"
    assert g["layers.0.self_attn"].flops == attention(B, H, T, T, d)  # k, v broadcast to H
    assert g["layers.0.input_layernorm"].kind == "norm"
    assert "runs in fp32 under autocast" in g["layers.0.input_layernorm"].disallowed["bf16"]
    attn_proj = 2 * linear(B * T, C, C) + 2 * linear(B * T, C, KV * d)
    per_layer = attn_proj + 3 * linear(B * T, C, F) + attention(B, H, T, T, d)
    assert g.total_flops == L * per_layer


def test_t5_encoder_decoder() -> None:
    case, g = traced("t5")
    B, T, C, H, D, F = (case.dims[k] for k in "BTCHDF")
    assert g.tracer == "export"
    check_every_linear(case, g, B * T)
    attn = 4 * linear(B * T, C, H * D) + attention(B, H, T, T, D)  # q, k, v, o + matmuls
    ffn = linear(B * T, C, F) + linear(B * T, F, C)
    for path in ("encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention",
                 "decoder.block.0.layer.1.EncDecAttention"):  # fmt: skip
        assert g[path].kind == "attention" and g[path].flops == attention(B, H, T, T, D), path
    # encoder: self-attention + FFN; decoder: self-attention + cross-attention + FFN
    assert g.total_flops == 3 * attn + 2 * ffn
    enc_out = "encoder.block.0.layer.1.DenseReluDense.wo"
    assert (enc_out, "decoder.block.0.layer.1.EncDecAttention.k") in g.edges


def test_vit_patch_conv() -> None:
    case, g = traced("vit")
    B, P, T, C = (case.dims[k] for k in "BPTC")
    assert g.tracer == "export"
    check_every_linear(case, g, B * T)
    conv = g["embeddings.patch_embeddings.projection"]
    assert conv.kind == "conv" and conv.flops == 2 * B * C * P * 3 * 4 * 4
    att = g["layers.0.attention"]
    assert att.kind == "attention" and att.flops == attention(B, 2, T, T, C // 2)
    assert (
        g.total_flops == conv.flops + 4 * linear(B * T, C, C) + 2 * linear(B * T, C, 64) + att.flops
    )


# ---------------------------------------------------------------- tracer behaviour


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert", "t5"])
def test_graph_tracers_agree_with_tensor_identity(name: str) -> None:
    case, g = traced(name)
    h = trace(case.model, case.batch, tracers=("hooks",))
    assert h.tracer == "hooks" and h.fallbacks == []
    assert g.tracer != "hooks" and set(g.edges) == set(h.edges)


def test_tracing_does_not_change_the_model() -> None:
    case = zoo.bert()
    model = case.model.train()  # train mode: dropout active, and must stay so
    model.encoder.layer[0].eval()  # a mixed state must come back exactly
    flags = {p: m.training for p, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trace(model, case.batch)
    assert {p: m.training for p, m in model.named_modules()} == flags
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(p.grad is None for p in model.parameters())


def test_attributes_cached_by_forward_are_restored() -> None:
    """fx runs forward on Proxies: a tensor cached on self must not survive as one."""

    class Caching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last_input = x
            return self.fc(x)

    model = Caching()
    g = trace(model, torch.randn(2, 4))
    assert g.tracer == "fx" and not hasattr(model, "last_input")
    model(torch.randn(2, 4))
    assert isinstance(model.last_input, torch.Tensor)
    trace(model, torch.randn(3, 4))
    assert model.last_input.shape == (2, 4)  # the user's own value is kept


def test_batchnorm_statistics_untouched_in_train_mode() -> None:
    case = zoo.cnn()
    model = case.model.train()
    mean = model.bn.running_mean.clone()
    trace(model, case.batch)
    assert torch.equal(model.bn.running_mean, mean) and model.bn.training


def test_export_time_guard_and_outer_alarm() -> None:
    import signal
    import threading
    import time

    class Stuck(nn.Module):
        """An export that never ends by itself: the exporting forward waits for an event
        nobody sets, until export_timeout's alarm interrupts the wait."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.never = threading.Event()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_exporting():
                self.never.wait(20)  # a bound, should the alarm never come: export then ends
            return self.fc(x)

    fired: list[int] = []
    old_handler = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    began = time.monotonic()
    old_timer = signal.setitimer(signal.ITIMER_REAL, 30.0)  # e.g. pytest-timeout's alarm
    try:
        g = trace(Stuck(), torch.randn(2, 4), tracers=("export",), export_timeout=0.1)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        elapsed = time.monotonic() - began
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, old_handler)
    assert g.tracer == "hooks"
    assert g.fallbacks == [("export", "gave up after 0.1 s (export_timeout)")]
    # The outer alarm is not consumed, and is restored where it was: still counting down
    # from 30 s, the 0.1 s the export took included (however long the trace took).
    assert not fired
    assert 30.0 - elapsed - 0.5 <= left < 30.0 - 0.05, (left, elapsed)


def test_unknown_tracer_name() -> None:
    with pytest.raises(ValueError, match="unknown tracer 'jit'"):
        trace(nn.Linear(2, 2), torch.randn(1, 2), tracers=("jit",))


def test_to_frame_and_json() -> None:
    _, g = traced("mlp")
    frame = g.to_frame()
    assert list(frame["layer"]) == ["<root>", "fc1", "act", "norm", "fc2", "drop", "head"]
    data = g.to_json()
    assert data["tracer"] == "fx" and data["total_flops"] == g.total_flops
    assert data["layers"][1]["disallowed"]["fp8"] == "in_features 100 not a multiple of 16"
