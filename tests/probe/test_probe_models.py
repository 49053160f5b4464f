"""Probing real model shapes: tied weights, in-place ops, non-tensor and HF outputs, KV
caches; and the model is left exactly as it was."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec.probe import probe
from tests.probe.probe_models import ids, tiny_bert, tiny_gpt2


class TiedInplace(nn.Module):
    """Embedding tied to the head, one Linear called twice, in-place ReLUs, tuple output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.block = nn.Linear(16, 16)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor):  # ids: (B, T)
        h = self.emb(ids)  # (B, T, C)
        h = self.act(self.block(h))  # in place on the Linear's output
        h = self.block(h)
        h.relu_()  # functional in-place op on the second call's output
        return self.head(h), {"tag": "x", "n": 3, "none": None}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: nn.Module, before: dict[str, torch.Tensor], training: bool) -> None:
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, name
        assert not m._forward_hooks and not m._forward_pre_hooks, name
        assert m.training == training, name
    assert all(p.grad is None for p in model.parameters())


def test_tied_weights_inplace_and_non_tensor_outputs():
    model = TiedInplace().train()  # the probe runs in eval mode and restores the flag
    before = _state(model)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (4, 6), generator=g) for _ in range(2)]

    def loss(out, batch):
        return out[0].float().pow(2).mean()

    table = probe(model, batches, ["bf16", "fp16", "fp8"], loss=loss, e2e="all",
                  progress=False)
    _assert_untouched(model, before, training=True)
    assert table.layers == ["block", "head"]
    block = table.row("block", "bf16")
    assert block.calls == 4  # called twice per batch
    assert block.estimate_method == "jacobian" and math.isfinite(block.cheap_estimate)
    assert 0 < block.e2e_error < 0.05
    # The Linear's output is modified in place by ReLU: local error still compares the
    # Linear's own output, so it is the plain bf16 rounding (~2**-9 relative).
    assert 1e-4 < block.local_error < 1e-2
    assert math.isfinite(table.row("head", "fp16").grad_error)
    assert not table.row("head", "fp8").hard  # 16 -> 32: fp8-eligible


def test_hf_bert_model_output_and_attention_rows():
    model = tiny_bert()
    before = _state(model)
    table = probe(model, ids(), ["bf16", "fp8"], e2e="none", progress=False)
    _assert_untouched(model, before, training=False)
    att = "encoder.layer.0.attention.self"
    assert att in table.layers and f"{att}.query" in table.layers
    row = table.row(att, "fp8")
    assert row.hard and not row.allowed and "Linear" in row.reason
    # The attention row measures its own matmuls (q/k/v Linears held at fp32).
    own = table.row(att, "bf16")
    assert 0 < own.local_error < 0.02 and math.isfinite(own.cheap_estimate)
    assert table.row(f"{att}.query", "fp8").allowed  # 32 x 32: fp8-eligible


def test_gpt2_kv_cache_is_not_corrupted_by_shadow_runs():
    batches = ids(n=1)  # (4, 8) token ids
    seen: list[int] = []

    def metric(out, batch) -> float:  # called on the probe pass's own outputs
        seen.append(out.cache.get_seq_length())
        return 0.0

    cached = probe(tiny_gpt2(use_cache=True), batches, ["bf16"], metric=metric, e2e="none",
                   progress=False)
    # The attention appends to the cache; its shadow re-runs work on a copy.
    assert seen == [8]
    plain = probe(tiny_gpt2(use_cache=False), batches, ["bf16"], e2e="none", progress=False)
    assert cached.layers == plain.layers
    for lay in plain.layers:
        assert cached.row(lay, "bf16").local_error == pytest.approx(
            plain.row(lay, "bf16").local_error, rel=1e-5), lay
    # lm_head shares the token embedding's weight (tied) and is probed like any Linear.
    assert "lm_head" in plain.layers and not plain.row("lm_head", "bf16").hard


def test_layers_argument_and_unknown_path():
    from autoprec.errors import InputError

    model = TiedInplace()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (4, 6), generator=g)]
    table = probe(model, batches, ["bf16"], layers=["head"], e2e="none", progress=False)
    assert table.layers == ["head"]
    with pytest.raises(InputError, match="'nope' is not a module"):
        probe(model, batches, ["bf16"], layers=["nope"], progress=False)
    with pytest.raises(InputError, match="not a GEMM layer"):
        probe(model, batches, ["bf16"], layers=["act"], progress=False)
    with pytest.raises(InputError, match="unknown precision 'fp12'"):
        probe(model, batches, ["fp12"], progress=False)
    with pytest.raises(InputError, match="probe: calibration yielded no batches"):
        probe(model, [], ["bf16"], progress=False)


def test_metric_makes_e2e_error_a_metric_drop(known_batches):
    from tests.probe.probe_models import Known

    labels = [torch.arange(len(x)) % 16 for x in known_batches]

    def metric(out, batch) -> float:  # accuracy of the "big" branch against fixed labels
        i = next(i for i, x in enumerate(known_batches) if x is batch)
        return float((out["big"].argmax(-1) == labels[i]).float().mean())

    table = probe(Known().eval(), known_batches, ["bf16", "fp16"], metric=metric,
                  e2e=[("big", "bf16"), ("big", "fp16"), ("robust", "bf16")], budget=0.05,
                  progress=False)
    assert table.meta["units"] == "metric_drop"
    assert table.row("robust", "bf16").e2e_error == 0.0  # the metric ignores that branch
    assert table.row("robust", "bf16").e2e_output_error > 0.0
    big16 = table.row("big", "fp16")
    assert math.isinf(big16.e2e_error) and big16.hard
    assert "non-finite model output" in big16.reason


def test_compiled_wrapper_is_probed_through_the_model_it_wraps():
    model = TiedInplace()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (4, 6), generator=g)]
    wrapped = torch.compile(model)  # lazy: nothing compiles unless it is called
    table = probe(wrapped, batches, ["bf16"], layers=["_orig_mod.head"], e2e="none",
                  progress=False)
    assert table.layers == ["head"]
