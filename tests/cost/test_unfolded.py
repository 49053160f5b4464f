"""GEMMs inductor does not fold (``cost.unfolded``): found, timed as the bmm inductor runs,
priced where the plan casts their weight (the training form) and nowhere else."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.cost import get_profile
from autoprec.cost.model import make_cost_model
from autoprec.cost.unfolded import unfolded_gemms
from autoprec.measure.op_runner import _Builder, _Runner
from autoprec.measure.op_times import OpTimes, measure
from autoprec.policy import Policy
from autoprec.trace import trace
from tests import zoo
from tests.helpers import one_torch_thread


class _Encoder(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def _graph(batch_first: bool = True):  # noqa: ANN202
    torch.manual_seed(0)
    x = torch.randn(4, 6, 32) if batch_first else torch.randn(6, 4, 32)
    return trace(_Encoder(batch_first).eval(), x)


def test_the_in_projection_of_a_batch_first_attention_is_found_once_per_layer() -> None:
    g = _graph()
    got = unfolded_gemms(g.ops)
    assert [g.ops.modules[g.ops.ops[i].module] for i in got] == [
        "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    x, w = next(iter(got.values()))["a"]
    # (T, B, K) after MHA's transpose, contiguous as inductor writes it; batch in dim 1
    assert (x["shape"], x["stride"], x["bdim"]) == ([6, 4, 32], [128, 32, 1], 1)
    assert g.ops.values[w["t"]].source == "param"
    assert (w["shape"], w["stride"]) == ([6, 32, 96], [0, 1, 32])  # W.t() expanded


def test_contiguous_inputs_fold_and_are_not_found() -> None:
    assert unfolded_gemms(_graph(batch_first=False).ops) == {}  # (T, B, E): no transpose
    assert unfolded_gemms(trace(zoo.mlp().model, zoo.mlp().batch).ops) == {}


def test_the_bmm_recipe_rebuilds_its_broadcast_weight_and_scales_the_batch_dimension() -> None:
    g = _graph()
    recipe = next(iter(unfolded_gemms(g.ops).values()))
    x = _Builder(g.ops, 2.0).build(recipe["a"], torch.bfloat16)
    assert x[0].shape == (6, 8, 32) and x[0].is_contiguous()  # the batch (4) doubled
    assert x[1].shape == (6, 32, 96) and x[1].stride() == (0, 1, 32)
    assert torch.isfinite(torch.bmm(*x)).all()
    with one_torch_thread():
        assert _Runner(g.ops, 1.0, 0).seconds(recipe, torch.bfloat16) > 0


def test_measured_and_priced_only_where_the_training_form_casts_the_weight() -> None:
    g = _graph()
    found = sorted(unfolded_gemms(g.ops))
    with one_torch_thread():
        got = measure(g.ops, g.batch_size)
    assert sorted(got.compute_unfolded) == found
    assert all(set(got.compute_unfolded[i]) == {"fp32", "bf16", "fp16"} for i in found)
    # priced: every GEMM 1 ms folded, 10 ms unfolded
    gemms = [i for i, op in enumerate(g.ops.ops) if op.kind == "gemm"]
    hand = OpTimes(g.batch_size, compute={i: dict.fromkeys(("fp32", "bf16", "fp16"), 1e-3)
                                          for i in gemms},
                   compute_unfolded={i: dict.fromkeys(("fp32", "bf16", "fp16"), 1e-2)
                                     for i in found})
    prof = get_profile("cpu")

    def gemm_s(mode: str, policy: Policy, times: OpTimes) -> float:
        cost = make_cost_model(g, prof, g.batch_size, mode, form=policy.form, op_times=times)
        return cost.breakdown(policy).parts["gemm"]

    folded = OpTimes(g.batch_size, compute=hand.compute)
    train, deploy = Policy(default="bf16", form="train"), Policy(default="bf16", form="deploy")
    extra = len(found) * (1e-2 - 1e-3)
    assert gemm_s("compile", train, hand) == pytest.approx(
        gemm_s("compile", train, folded) + extra, rel=1e-9)
    assert gemm_s("compile", deploy, hand) == pytest.approx(  # stored bf16: a parameter
        gemm_s("compile", deploy, folded), rel=1e-9)
    fp32 = Policy(default="fp32", form="train")  # no cast: folded
    assert gemm_s("compile", fp32, hand) == pytest.approx(gemm_s("compile", fp32, folded))
    assert gemm_s("eager", train, hand) == pytest.approx(  # eager autocast folds
        gemm_s("eager", train, folded), rel=1e-9)
    # the attention module kept in fp32 inside a bf16 plan: its weight is not cast
    keep = Policy(default="bf16", form="train",
                  layers={f"encoder.layers.{k}.self_attn": "fp32" for k in range(2)})
    assert gemm_s("compile", keep, hand) == pytest.approx(gemm_s("compile", keep, folded))


class _MatmulT(nn.Module):
    """A model's own ``x @ W.t()`` over a transposed 3-D input: the fold is recorded as
    ``clone`` -> ``_unsafe_view`` -> ``mm`` (no ``linear`` op)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x.transpose(0, 1), self.w.t())


def test_a_models_own_matmul_over_a_transposed_input_is_found_too() -> None:
    g = trace(_MatmulT().eval(), torch.randn(4, 6, 16))
    got = unfolded_gemms(g.ops)
    assert [g.ops.ops[i].name for i in got] == ["mm"]
    x, w = next(iter(got.values()))["a"]
    assert (x["shape"], w["shape"], w["stride"]) == ([6, 4, 16], [6, 16, 24], [0, 1, 16])


def test_a_weight_is_rebuilt_requiring_grad_so_eager_folds_as_in_the_model() -> None:
    """torch's matmul folds a transposed 3-D input into one mm only when the weight requires
    grad (a parameter does, in both forms); rebuilt without it the op timing ran a bmm over
    the expanded weight (nn_transformer's in-projection: 2.7 ms in bf16 against 0.2 ms)."""
    from torch.profiler import profile

    g = _graph()
    i = next(iter(unfolded_gemms(g.ops)))  # the in-projection, recorded as one linear
    recipe = g.ops.ops[i].recipe
    assert recipe["f"] == "F.linear"
    args = _Builder(g.ops, 1.0).build(recipe["a"], torch.bfloat16)
    assert [a.requires_grad for a in args] == [False, True, True]  # input, weight, bias
    with torch.no_grad(), profile() as prof:
        torch.nn.functional.linear(*args)
    ran = {e.key for e in prof.key_averages()}
    assert "aten::mm" in ran and "aten::bmm" not in ran
