"""The fixed training recipes as policies, checked against the model's exact paths, and the
decision rule that writes a recipe where the tuned plan does not beat it."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import StepPart
from autoprec.evaluation.decision import Fallback, Timing, decide, recipe_instead
from autoprec.evaluation.recipes import (
    NVFP4_ALIGN,
    NVFP4_TAIL,
    RECIPES,
    decoder_blocks,
    diff_provenance,
    differences,
    lm_head,
    recipe_plans,
    recipe_rows,
    torchao_keeps,
)
from autoprec.evaluation.rows import Row
from autoprec.policy import Policy
from autoprec.trace.shape_only import trace_shapes

transformers = pytest.importorskip("transformers")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _meta_llama(layers: int, hidden: int = 64, inter: int = 128, heads: int = 4,
                vocab: int = 256) -> tuple[torch.nn.Module, object]:
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=2 if heads == 4 else 8, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    graph = trace_shapes(model, torch.randint(0, vocab, (1, 16)),
                         forward=lambda m, b: m(input_ids=b).logits)
    return model, graph


@pytest.fixture(scope="module")
def seven() -> tuple:
    # 128 wide: k_proj / v_proj project to 2 KV heads x 32 = 64 features, under NVFP4's 128
    return _meta_llama(7, hidden=128, inter=256)


def _linears(blocks: range) -> set[str]:
    return {f"model.layers.{b}.{name}" for b in blocks for name in LINEARS}


def test_structure_of_a_llama(seven: tuple) -> None:
    model, _ = seven
    assert decoder_blocks(model) == [f"model.layers.{i}" for i in range(7)]
    assert lm_head(model) == "lm_head"


def test_each_recipe_on_exact_paths(seven: tuple) -> None:
    model, graph = seven
    plans = {p.recipe.key: p for p in recipe_plans(model, graph)}
    assert set(plans) == {r.key for r in RECIPES}
    tail = math.ceil(NVFP4_TAIL * 7)
    assert tail == 2  # ceil(1.05): torchtitan keeps the last two of seven blocks
    # torchao's NVFP4 kernels need every GEMM dim a multiple of 128: k_proj / v_proj
    # (128 -> 64) stay bf16 in both NVFP4 recipes, as torchtitan cannot convert them
    narrow = {f"model.layers.{b}.self_attn.{n}" for b in range(7) for n in ("k_proj", "v_proj")}
    p = plans["nvfp4-tail"]
    assert set(p.policy.layers) == _linears(range(7 - tail)) - narrow
    assert set(p.policy.layers.values()) == {"nvfp4"}
    assert p.bf16_blocks == ("model.layers.5", "model.layers.6")
    assert p.policy.default == "bf16" and p.policy.form == "train"
    assert set(plans["nvfp4"].policy.layers) == _linears(range(7)) - narrow  # no LM head
    assert set(plans["mxfp8"].policy.layers) == _linears(range(7))  # 16-aligned suffices
    for key, fmt in (("megatron-first-last", "fp8"), ("megatron-first-last-mxfp8", "mxfp8")):
        meg = plans[key]
        assert set(meg.policy.layers) == _linears(range(1, 6))
        assert set(meg.policy.layers.values()) == {fmt}
        assert meg.bf16_blocks == ("model.layers.0", "model.layers.6")
    assert set(plans["fp8"].policy.layers) == _linears(range(7)) | {"lm_head"}
    # 128 wide: every block Linear is under torchao's thresholds; the 256-vocabulary head too
    assert plans["torchao-tensorwise"].policy.layers == {}
    assert plans["torchao-rowwise"].policy.layers == {}


@pytest.mark.parametrize("layers,tail", [(32, 5), (80, 12), (2, 1), (1, 1)])
def test_tail_is_ceil_fifteen_percent(layers: int, tail: int) -> None:
    assert math.ceil(NVFP4_TAIL * layers) == tail  # torchtitan: layers 27-31 of 32 in bf16


def test_torchao_rule_is_torchao_s_own() -> None:
    ao = pytest.importorskip("torchao.float8")
    dims = [16, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 14336, 28672, 128256, 100]
    for recipe in ("tensorwise", "rowwise"):
        keep = ao._auto_filter_for_recipe(recipe, [])
        for n in dims:
            for k in dims:
                with torch.device("meta"):
                    lin = torch.nn.Linear(k, n)  # weight (n, k): N = out, K = in
                assert torchao_keeps(recipe, n, k) == keep(lin, "x"), (recipe, n, k)


def test_torchao_filters_a_llama3_8b_block() -> None:
    model, graph = _meta_llama(2, hidden=4096, inter=14336, heads=32, vocab=1024)
    plans = {p.recipe.key: p for p in recipe_plans(model, graph)}
    ao = pytest.importorskip("torchao.float8")
    for recipe in ("tensorwise", "rowwise"):
        keep = ao._auto_filter_for_recipe(recipe, [])
        want = {path for path, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and keep(m, path)}
        assert set(plans[f"torchao-{recipe}"].policy.layers) == want
    # k_proj / v_proj (4096 -> 1024) are the ones both skip; the 1024-vocabulary head too
    assert set(plans["torchao-tensorwise"].policy.layers) == (
        _linears(range(2)) - {f"model.layers.{b}.self_attn.{p}" for b in range(2)
                              for p in ("k_proj", "v_proj")})
    # every Llama-3-8B width is a multiple of 128: NVFP4 converts every block Linear, and
    # with two blocks the tail keeps ceil(0.3) = 1 of them
    assert set(plans["nvfp4"].policy.layers) == _linears(range(2))
    assert set(plans["nvfp4-tail"].policy.layers) == _linears(range(1))


def test_nvfp4_alignment_is_torchtitan_s() -> None:
    from autoprec.evaluation.recipes import aligned

    assert NVFP4_ALIGN == 128
    with torch.device("meta"):
        assert aligned(torch.nn.Linear(4096, 14336), 128)
        assert not aligned(torch.nn.Linear(4096, 10944), 128)  # DeepSeek-V3 16B's FFN
        assert not aligned(torch.nn.Linear(128, 64), 128)
        assert not aligned(torch.nn.LayerNorm(128), 128)  # no 2-D weight
        conv1d = transformers.pytorch_utils.Conv1D(256, 128)  # GPT-2's: weight (in, out)
    assert aligned(conv1d, 128)


def test_recipe_rows_priced_and_not_faked(seven: tuple) -> None:
    model, graph = seven
    plans = recipe_plans(model, graph)
    for dev in ("h100", "b200"):
        cost = CostModel(graph, get_profile(dev), 8, step=StepPart())
        rows = {r.name: r for r in recipe_rows(cost, plans, None, None, train_aware=True)}
        assert len(rows) == len(RECIPES)
        for r in rows.values():
            assert r.role == "recipe" and not r.feasible
        meg = rows["fp8, first/last block bf16 (Megatron)"]
        assert meg.est_speedup and meg.est_speedup > 0
        assert meg.why_not == "not scored (priced only)"
        nv = rows["nvfp4 + bf16 tail (torchtitan)"]
        if dev == "h100":
            assert nv.policy is None and nv.why_not.startswith("not on h100: nvfp4: Hopper")
        else:
            assert nv.est_speedup and nv.est_speedup > 0
        assert "converts no layer" in rows["fp8 torchao auto-filter (tensorwise)"].why_not


def test_differences_name_each_layer(seven: tuple) -> None:
    model, graph = seven
    rec = {p.recipe.key: p for p in recipe_plans(model, graph)}["megatron-first-last"].policy
    plan = Policy(default="bf16", layers={**rec.layers, "model.layers.3.mlp.down_proj": "bf16",
                                          "model.layers.0.mlp": "fp8"},
                  reasons={"model.layers.3.mlp.down_proj": "fp8 alone over budget"})
    leaves = [n.path for n in graph.gemm_nodes if n.is_leaf]
    got = differences(plan, rec, leaves)
    assert [(d.path, d.recipe, d.plan, d.why) for d in got] == [
        ("model.layers.0.mlp.gate_proj", "bf16", "fp8", ""),
        ("model.layers.0.mlp.up_proj", "bf16", "fp8", ""),
        ("model.layers.0.mlp.down_proj", "bf16", "fp8", ""),
        ("model.layers.3.mlp.down_proj", "fp8", "bf16", "fp8 alone over budget")]
    prov = diff_provenance("Megatron", got)
    assert prov["layers_differing"] == "4"
    assert prov["model.layers.3.mlp.down_proj"] == "fp8 -> bf16: fp8 alone over budget"
    Policy(default="bf16", provenance={"versus_recipe": prov})  # a valid policy field


def _row(name: str, role: str, est: float, feasible: bool = True) -> Row:
    return Row(name, role, Policy(default="bf16", layers={"a": "fp8"} if role != "baseline"
                                  else {}), 0.01, feasible, est)


def test_the_tuned_plan_is_written_only_when_it_beats_the_best_recipe() -> None:
    t = Timing(note="not here")
    rows = [_row("tuned", "tuned", 1.30), _row("bf16", "baseline", 1.10),
            _row("megatron", "recipe", 1.25), _row("nvfp4", "recipe", 1.40, feasible=False)]
    assert recipe_instead(rows) is None
    assert decide(rows, t, trains=True).winner.name == "tuned"
    rows[0].est_speedup = 1.25  # as fast as the best recipe within budget: not beaten
    d = decide(rows, t, trains=True)
    assert d.winner.name == "megatron"
    assert d.reasons[-1].fallback is Fallback.RECIPE_FASTER
    rows[0].est_speedup, rows[0].feasible = 1.5, False  # over budget: the recipe is written
    assert decide(rows, t, trains=True).winner.name == "megatron"
    rows[1].est_speedup = 1.3  # a faster one-liner within budget: the other rules decide
    assert recipe_instead(rows) is None


def test_priced_in_the_order_torchtitan_measured() -> None:
    # Llama-3 8B's widths, 8 blocks (the tail keeps 2), 16 x 2048 tokens: GEMM-bound, as
    # torchtitan's runs (bf16 < MXFP8 < NVFP4 + tail < NVFP4 everywhere on B200 tokens/s)
    model, graph = _meta_llama(8, hidden=4096, inter=14336, heads=32, vocab=1024)
    plans = {p.recipe.key: p.policy for p in recipe_plans(model, graph)}
    for dev, order in (("b200", ("bf16", "mxfp8", "nvfp4-tail", "nvfp4")),
                       ("h100", ("bf16", "megatron-first-last", "fp8"))):
        cost = CostModel(graph, get_profile(dev), 2048, step=StepPart())
        step = {k: cost.estimate(Policy(default="bf16", form="train") if k == "bf16"
                                 else plans[k]) for k in order}
        assert [step[k] for k in order] == sorted(step.values(), reverse=True), (dev, step)
        assert step["bf16"] / step[order[-1]] < 2.0  # casts, quantisation, the rest stay
