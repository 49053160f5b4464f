"""CostModel: roofline arithmetic by hand, casts, fp8 passes, ordering, batch scaling."""

from __future__ import annotations

import functools
import math
import time

import numpy as np
import pytest

from autoprec.cost import CostModel, get_profile
from autoprec.cost.calibrate import gemm_graph
from autoprec.errors import InputError
from autoprec.precisions import PRECISIONS
from tests.cost.graphs import TOY, chain, graph, lin, other

L = 1e-6  # TOY launch overhead

# Most cases below price 16-bit activations flowing between layers (the default); the
# exit casts apply does on per-layer policies (exit_cast=True) have tests at the end.
_CostModel = functools.partial(CostModel, exit_cast=True)


# ----------------------------------------------------------------- hand-computed roofline


def test_compute_bound_fp32_gemm_by_hand():
    cm = CostModel(gemm_graph(1000, 1000, 1000), TOY)
    # 2e9 FLOP / 1e12 FLOP/s = 2 ms  >  4 B x 3e6 elements / 1e11 B/s = 0.12 ms
    assert cm.estimate({}) == pytest.approx(2e-3 + L)
    assert cm.estimate({"gemm": "tf32"}) == pytest.approx(1e-3 + L)  # 2e9 / 2e12


def test_memory_bound_gemm_by_hand():
    cm = CostModel(gemm_graph(1, 1000, 1000), TOY)
    # 2e6 FLOP -> 2 us; bytes 4 x (1e6 weights + 1e3 in + 1e3 out) -> 40.08 us
    assert cm.estimate({}) == pytest.approx(4.008e-5 + L)
    assert cm.breakdown({})[0].bound == "memory"


def test_bf16_prices_gemm_weight_cast_and_input_cast():
    cm = CostModel(gemm_graph(1000, 1000, 1000), TOY)
    gemm = 2e9 / 4e12 + L  # 0.5 ms; 2 B x 3e6 = 60 us of traffic hides under it
    weight_cast = 1e6 * (4 + 2) / 1e11 + L  # autocast casts the fp32 master every call
    input_cast = 1e6 * (4 + 2) / 1e11 + L  # the model input arrives fp32
    assert cm.estimate({"gemm": "bf16"}) == pytest.approx(gemm + weight_cast + input_cast)
    once = CostModel(gemm_graph(1000, 1000, 1000), TOY, autocast_weight_cast="once")
    assert once.estimate({"gemm": "bf16"}) == pytest.approx(gemm + input_cast)


def test_fp8_current_scaling_passes_by_hand():
    cm = CostModel(gemm_graph(1000, 1000, 1000), TOY)
    gemm = 2e9 / 8e12 + L  # 1-byte weights and input, 2-byte output: 4e6 B -> 40 us, hidden
    amax = 1e6 * 4 / 1e11 + L  # read the fp32 input
    scale = L  # amax -> scale, launch only
    cast = 1e6 * (4 + 1) / 1e11 + L  # read fp32, write e4m3
    assert cm.estimate({"gemm": "fp8"}) == pytest.approx(gemm + amax + scale + cast)
    kinds = [k.what for _, k in cm.kernels({"gemm": "fp8"})]
    assert kinds == ["amax", "fp8_scale", "fp8_cast", "gemm"]  # weights: cast once, not here
    per_call = CostModel(gemm_graph(1000, 1000, 1000), TOY, fp8_weight_cast="per_call")
    extra = 1e6 * 4 / 1e11 + L + 1e6 * 5 / 1e11 + L
    assert per_call.estimate({"gemm": "fp8"}) == pytest.approx(cm.estimate({"gemm": "fp8"})
                                                              + extra)


def test_fp8_gemm_writes_16_bit_output():
    (gemm,) = [k for _, k in CostModel(gemm_graph(10, 32, 64), TOY).kernels({"gemm": "fp8"})
               if k.what == "gemm"]
    assert gemm.bytes == 32 * 64 * 1 + 10 * 32 * 1 + 10 * 64 * 2


# ----------------------------------------------------------------- ordering on real profiles


def test_h100_large_gemm_fp8_faster_than_bf16_faster_than_fp32():
    cm = CostModel(gemm_graph(8192, 8192, 8192), get_profile("h100"))
    t = {p: cm.estimate({"gemm": p}) for p in PRECISIONS}
    assert t["fp8"] < t["bf16"] < t["tf32"] < t["fp32"]
    assert t["bf16"] == t["fp16"]
    assert cm.speedup({"gemm": "fp8"}) > 15  # ~1979 / 67 TF minus the cast passes


def test_h100_tiny_gemm_is_launch_bound_and_gains_nothing():
    cm = CostModel(gemm_graph(16, 64, 64), get_profile("h100"))
    assert cm.breakdown({})[0].bound == "launch"
    assert cm.speedup({"gemm": "bf16"}) <= 1.0
    assert cm.speedup({"gemm": "fp8"}) <= 1.0
    assert cm.estimate({"gemm": "fp8"}) > cm.estimate({"gemm": "bf16"})


def test_fp8_loses_at_small_batch_and_wins_at_deployment_batch():
    # A 4096x4096 Linear traced with one 128-token sequence; bf16 weights pre-cast (with
    # autocast's per-call weight cast, bf16 would lose to fp8's cached weights here).
    g = graph(lin("fc", 128, 4096, 4096), batch_size=1)
    small = CostModel(g, get_profile("h100"), batch_size=1, autocast_weight_cast="once")
    big = CostModel(g, get_profile("h100"), batch_size=256, autocast_weight_cast="once")
    assert small.estimate({"fc": "fp8"}) > small.estimate({"fc": "bf16"})
    assert big.estimate({"fc": "fp8"}) < big.estimate({"fc": "bf16"})


# ----------------------------------------------------------------- feasibility


def test_fp8_infeasible_on_a100_with_reason():
    cm = CostModel(gemm_graph(64, 64, 64), get_profile("a100"))
    assert math.isinf(cm.estimate({"gemm": "fp8"}))
    assert cm.speedup({"gemm": "fp8"}) == 0.0
    (why,) = cm.infeasible({"gemm": "fp8"})
    assert why.startswith("gemm: fp8: a100 has no fp8 tensor cores")
    assert cm.infeasible({"gemm": "bf16"}) == []


def test_bf16_and_tf32_infeasible_on_t4():
    cm = CostModel(gemm_graph(64, 64, 64), get_profile("t4"))
    assert "bf16: t4" in cm.infeasible({"gemm": "bf16"})[0]
    assert "tf32: t4" in cm.infeasible({"gemm": "tf32"})[0]
    assert cm.infeasible({"gemm": "fp16"}) == []
    assert math.isfinite(cm.estimate({"gemm": "fp16"}))


def test_unsupported_default_makes_every_unassigned_layer_infeasible():
    cm = CostModel(chain(3, 8, 16), get_profile("t4"), default="bf16")
    assert len(cm.infeasible({"fc1": "fp16"})) == 2


def test_layer_disallowed_reason_is_reported():
    node = lin("head", 8, 10, 10)
    node.allowed = ["fp32", "tf32", "bf16", "fp16"]
    node.disallowed = {"fp8": "fp8: in_features 10 not a multiple of 16"}
    cm = CostModel(graph(node), get_profile("h100"))
    assert cm.infeasible({"head": "fp8"}) == ["head: fp8: in_features 10 not a multiple of 16"]


# ----------------------------------------------------------------- casts at boundaries


def _casts(cm: CostModel, assignment: dict[str, str]) -> dict[str, float]:
    return {r.layer: r.cast_s for r in cm.breakdown(assignment) if r.kind == "linear"}


def test_casts_appear_exactly_at_precision_boundaries():
    cm = CostModel(chain(3, 1000, 1000), TOY)  # fc0 -> fc1 -> fc2, 1e6-element activations
    up_or_down = 1e6 * (4 + 2) / 1e11 + L
    assert _casts(cm, {}) == {"fc0": 0.0, "fc1": 0.0, "fc2": 0.0}
    all_bf16 = _casts(cm, {"fc0": "bf16", "fc1": "bf16", "fc2": "bf16"})
    assert all_bf16 == pytest.approx({"fc0": up_or_down, "fc1": 0.0, "fc2": 0.0})
    island = _casts(cm, {"fc1": "bf16"})  # fp32 -> bf16 into fc1, bf16 -> fp32 into fc2
    assert island == pytest.approx({"fc0": 0.0, "fc1": up_or_down, "fc2": up_or_down})
    mixed16 = _casts(cm, {"fc0": "bf16", "fc1": "fp16", "fc2": "fp16"})
    assert mixed16 == pytest.approx({"fc0": up_or_down, "fc1": 1e6 * 4 / 1e11 + L, "fc2": 0.0})
    tf32 = _casts(cm, {"fc1": "tf32"})  # tf32 is stored as fp32: no cast
    assert tf32 == {"fc0": 0.0, "fc1": 0.0, "fc2": 0.0}
    after_fp8 = _casts(cm, {"fc1": "fp8", "fc2": "bf16"})  # fp8 emits bf16
    assert after_fp8["fc2"] == 0.0


def test_producers_come_from_graph_edges_not_execution_order():
    # fc2 reads fc0's output (e.g. a skip), not fc1's.
    g = graph(lin("fc0", 100, 100, 100), lin("fc1", 100, 100, 100),
              lin("fc2", 100, 100, 100), edges=[("fc0", "fc1"), ("fc0", "fc2")])
    cm = CostModel(g, TOY)
    assert cm.flow == "graph"
    assert _casts(cm, {"fc0": "bf16", "fc2": "bf16"})["fc2"] == 0.0
    # without any data-flow information the previous GEMM is the producer
    g.edges = []
    cm2 = CostModel(g, TOY)
    assert cm2.flow == "execution order"
    assert _casts(cm2, {"fc0": "bf16", "fc2": "bf16"})["fc2"] > 0.0


def test_merge_of_producers_follows_type_promotion():
    # fc2 reads a + b (a residual add) of fc0's and fc1's outputs.
    g = graph(lin("fc0", 100, 100, 100), lin("fc1", 100, 100, 100),
              lin("fc2", 100, 100, 100, inputs_from=["fc0", "fc1"]))
    cm = CostModel(g, TOY)
    whole = 1e4 * (4 + 2) / 1e11 + L  # the merged tensor, cast once
    assert _casts(cm, {"fc0": "bf16", "fc1": "bf16", "fc2": "bf16"})["fc2"] == 0.0
    assert _casts(cm, {"fc0": "bf16", "fc2": "bf16"})["fc2"] == pytest.approx(whole)
    # bf16 + fp16 promotes to fp32
    assert _casts(cm, {"fc0": "bf16", "fc1": "fp16", "fc2": "bf16"})["fc2"] == \
        pytest.approx(whole)


# ----------------------------------------------------------------- non-GEMM nodes


def test_norm_priced_memory_bound_at_its_producers_dtype():
    g = graph(lin("fc", 100, 100, 100), other("ln", "norm", 10_000, weight=200,
                                               inputs_from=["fc"]))
    cm = CostModel(g, TOY)
    assert cm.layer_times({})["ln"] == pytest.approx((4 * 20_000 + 4 * 200) / 1e11 + L)
    assert cm.layer_times({"fc": "bf16"})["ln"] == pytest.approx((2 * 20_000 + 4 * 200) / 1e11
                                                                 + L)
    assert cm.breakdown({"fc": "fp8"})[1].precision == "bf16"


def test_norm_without_inputs_from_takes_nearest_earlier_gemm():
    g = graph(lin("fc", 100, 100, 100), other("act", "activation", 10_000))
    assert CostModel(g, TOY).breakdown({"fc": "fp16"})[1].precision == "fp16"


def test_containers_cost_nothing_unless_they_compute_and_dropout_is_free():
    box = other("block", "container", 1000, is_leaf=False)
    adds = other("res", "container", 1000, flops=1000, is_leaf=False)
    drop = other("drop", "dropout", 1000)
    emb = other("emb", "embedding", 0)
    emb.out_elems, emb.weight_elems = 640, 50_000 * 64
    cm = CostModel(graph(box, adds, drop, emb, lin("fc", 10, 64, 64)), TOY)
    times = cm.layer_times({})
    assert "block" not in times
    assert times["drop"] == 0.0
    assert times["res"] == pytest.approx(4 * 2000 / 1e11 + L)
    assert times["emb"] == pytest.approx(8 * 640 / 1e11 + L)  # gathered rows, not the table


def test_layer_times_sum_to_estimate():
    cm = CostModel(chain(6, 64, 256, with_norms=True), get_profile("h100"), batch_size=32)
    a = {"fc1": "bf16", "fc2": "fp8", "fc4": "fp16"}
    assert sum(cm.layer_times(a).values()) == pytest.approx(cm.estimate(a))
    assert list(cm.layer_times(a))[:3] == ["fc0", "ln0", "fc1"]


# ----------------------------------------------------------------- batch scaling


def test_batch_size_scales_activations_not_weights():
    g = graph(lin("fc", 16, 128, 256), batch_size=2)  # traced: 2 sequences, 16 tokens
    base = CostModel(g, TOY)
    big = CostModel(g, TOY, batch_size=8)
    assert big.scale == 4.0
    (k1,) = [k for _, k in base.kernels({})]
    (k4,) = [k for _, k in big.kernels({})]
    assert k4.flops == 4 * k1.flops
    w, i, o = 128 * 256, 16 * 128, 16 * 256
    assert k1.bytes == 4 * (w + i + o)
    assert k4.bytes == 4 * (w + 4 * i + 4 * o)  # weights fixed, activations x4
    assert k4.launches == k1.launches
    assert CostModel(g, TOY, batch_size=2).estimate({}) == base.estimate({})


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_batch_size_is_input_error(bad):
    with pytest.raises(InputError, match="batch-size"):
        CostModel(gemm_graph(4, 4, 4), TOY, batch_size=bad)


# ----------------------------------------------------------------- input errors


def test_rules_on_non_gemm_or_idle_layers_change_nothing():
    idle = lin("unused", 4, 16, 16)
    idle.calls = 0
    g = graph(lin("fc", 4, 16, 16), other("ln", "norm", 64, inputs_from=["fc"]), idle)
    cm = CostModel(g, TOY)
    assert cm.paths == ["fc"]
    assert cm.estimate({"ln": "bf16", "unused": "fp8"}) == cm.estimate({})


def test_unknown_layer_and_precision_are_input_errors():
    cm = CostModel(chain(2, 4, 16), TOY)
    with pytest.raises(InputError, match="'nope'"):
        cm.estimate({"nope": "bf16"})
    with pytest.raises(InputError, match="unknown precision 'int4'"):
        cm.estimate({"fc0": "int4"})
    with pytest.raises(InputError, match="unknown precision"):
        CostModel(chain(2, 4, 16), TOY, default="fp64")


# ----------------------------------------------------------------- speed of the hot path


def test_thousands_of_estimates_per_second_on_a_100_layer_graph():
    cm = CostModel(chain(100, 512, 1024, with_norms=True), get_profile("h100"), batch_size=8)
    rng = np.random.default_rng(0)
    choices = np.array(PRECISIONS)
    assignments = [dict(zip(cm.paths, rng.choice(choices, len(cm.paths)), strict=True))
                   for _ in range(2000)]
    t0 = time.perf_counter()
    times = [cm.estimate(a) for a in assignments]
    elapsed = time.perf_counter() - t0
    print(f"2000 estimates on {len(cm.paths)} GEMM + 100 norm nodes: {elapsed:.3f}s "
          f"({2000 / elapsed:.0f}/s)")
    assert elapsed < 5.0  # loose: ~0.1 s on the team's 2-core machines
    codes = np.stack([cm.encode(a) for a in assignments])
    np.testing.assert_allclose(cm.estimate_codes(codes), times, rtol=1e-12)


# ------------------------------------------------------- apply's exit casts (exit_cast=True)


def test_exit_cast_option_prices_the_cast_apply_does():
    flow = CostModel(gemm_graph(1000, 1000, 1000), TOY)
    wrapped = _CostModel(gemm_graph(1000, 1000, 1000), TOY)
    exit_cast = 1e6 * (2 + 4) / 1e11 + L  # read the bf16 output, write it back as fp32
    assert wrapped.estimate({"gemm": "bf16"}) == pytest.approx(
        flow.estimate({"gemm": "bf16"}) + exit_cast)
    assert wrapped.estimate({}) == flow.estimate({})  # fp32 pays nothing extra


def test_two_bf16_neighbours_recast_between_them_when_wrapped():
    g = chain(2, 1000, 1000)
    both = {"fc0": "bf16", "fc1": "bf16"}
    kinds = [k.what for _, k in _CostModel(g, TOY).kernels(both)]
    assert kinds.count("exit_cast") == 2 and kinds.count("input_cast") == 2
    kinds = [k.what for _, k in CostModel(g, TOY).kernels(both)]
    assert "exit_cast" not in kinds and kinds.count("input_cast") == 1
