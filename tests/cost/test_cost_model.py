"""CostModel: roofline arithmetic by hand, casts, fp8 passes, whole-forward pricing of real
traces, batch scaling, feasibility, and the vectorised path."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import nn

from autoprec.cost import CostModel, get_profile
from autoprec.cost.calibrate import gemm_graph
from autoprec.errors import InputError
from autoprec.policy import Policy
from autoprec.trace import trace
from tests.cost.graphs import TOY

L = 1e-6  # TOY launch overhead


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
    (_, k), = cm.kernels({})
    assert k.bound(TOY) == "memory"


def test_bf16_prices_gemm_weight_cast_and_input_cast():
    cm = CostModel(gemm_graph(1000, 1000, 1000), TOY)
    gemm = 2e9 / 4e12 + L  # 0.5 ms; 2 B x 3e6 = 60 us of traffic hides under it
    weight_cast = 1e6 * (4 + 2) / 1e11 + L  # autocast casts the fp32 master every call
    input_cast = 1e6 * (4 + 2) / 1e11 + L  # the model input arrives fp32
    exit_cast = 1e6 * (2 + 4) / 1e11 + L  # back to fp32 for the (fp32 default) caller
    assert cm.estimate({"gemm": "bf16"}) == pytest.approx(
        gemm + weight_cast + input_cast + exit_cast)
    bd = cm.breakdown({"gemm": "bf16"})
    assert (bd.casts, bd.weight_casts) == (2, 1)
    assert bd.parts["cast"] == pytest.approx(weight_cast + input_cast + exit_cast)
    # the same GEMM in a bf16 region: its output stays bf16 (the root returns it as is)
    assert cm.estimate(Policy(default="bf16")) == pytest.approx(gemm + weight_cast + input_cast)


def test_fp8_current_scaling_passes_by_hand():
    cm = CostModel(gemm_graph(1024, 1024, 1024), TOY)
    n = 1024 * 1024
    gemm = 2 * 1024**3 / 8e12 + L  # 1-byte operands, fp32 output (fp32 region): hidden
    amax = n * 4 / 1e11 + L  # read the fp32 input
    scale = L  # amax -> scale, launch only
    cast = n * (4 + 1) / 1e11 + L  # read fp32, write e4m3
    assert cm.estimate({"gemm": "fp8"}) == pytest.approx(gemm + amax + scale + cast)
    kinds = [k.what for _, k in cm.kernels({"gemm": "fp8"})]
    assert sorted(kinds) == ["amax", "fp8_cast", "fp8_scale", "gemm"]  # weights: cast once
    bd = cm.breakdown({"gemm": "fp8"})
    assert bd.parts["gemm_format_scaling"] == pytest.approx(amax + scale + cast)


def test_fp8_gemm_writes_the_regions_16_bit_dtype():
    cm = CostModel(gemm_graph(1024, 1024, 1024), TOY)
    (gemm,) = [k for _, k in cm.kernels(Policy(default="bf16", layers={"gemm": "fp8"}))
               if k.what == "gemm"]
    assert gemm.bytes == 1024 * 1024 * (1 + 1 + 2)  # x, w in e4m3; y in bf16


def test_h100_large_gemm_fp8_faster_than_bf16_faster_than_fp32():
    cm = CostModel(gemm_graph(8192, 8192, 8192), get_profile("h100"))
    t = {p: cm.estimate({"gemm": p}) for p in ("fp32", "tf32", "bf16", "fp8")}
    assert t["fp8"] < t["bf16"] < t["tf32"] < t["fp32"]
    assert 1.5 < t["bf16"] / t["fp8"] < 2.1  # fp8 halves the GEMM; scaling passes cost some


def test_h100_tiny_gemm_is_launch_bound_and_gains_nothing():
    cm = CostModel(gemm_graph(16, 64, 64), get_profile("h100"))
    (_, k), = cm.kernels({})
    assert k.bound(get_profile("h100")) == "launch"
    assert cm.speedup({"gemm": "bf16"}) < 1.0  # the casts cost more than the GEMM saves


def test_fp8_loses_on_a_small_gemm_and_wins_on_a_large_one():
    """Three extra launches (amax, scale, cast) cost more than a small GEMM saves in fp8;
    a large one halves. (At 16 rows a 4096x4096 bf16 layer already loses: autocast
    re-casts its 16M-element fp32 weight on every call, the fp8 weight is cast once.)"""
    pol_bf16 = Policy(default="bf16")
    pol_fp8 = Policy(default="bf16", layers={"gemm": "fp8"})
    small = CostModel(gemm_graph(16, 256, 256), get_profile("h100"), batch_size=512)
    assert small.estimate(pol_fp8) > small.estimate(pol_bf16)
    big = CostModel(gemm_graph(16, 4096, 4096), get_profile("h100"), batch_size=512)
    assert big.estimate(pol_fp8) < 0.7 * big.estimate(pol_bf16)


def test_a_precision_the_device_lacks_is_infeasible_with_the_reason():
    cm = CostModel(gemm_graph(64, 64, 64), get_profile("a100"))
    assert math.isinf(cm.estimate({"gemm": "fp8"}))
    assert cm.speedup({"gemm": "fp8"}) == 0.0
    assert "fp8" in cm.cannot_run({"gemm": "fp8"})[0]
    t4 = CostModel(gemm_graph(64, 64, 64), get_profile("t4"))
    assert "bf16" in t4.cannot_run(Policy(default="bf16"))[0]  # a region, not only a GEMM
    assert math.isinf(t4.estimate(Policy(default="fp32", layers={"gemm": "tf32"})))
    assert t4.cannot_run({}) == []


def test_bad_batch_size_and_unknown_paths_are_input_errors():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="batch-size"):
            CostModel(gemm_graph(4, 4, 4), TOY, batch_size=bad)
    cm = CostModel(gemm_graph(4, 4, 4), TOY)
    with pytest.raises(InputError, match="no module 'nope'"):
        cm.estimate({"nope": "bf16"})
    with pytest.raises(InputError, match="unknown precision"):
        cm.estimate({"gemm": "fp12"})


# --------------------------------------------------------- whole forwards of real traces

class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d): pre-norm residual MLP
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _traced(d: int = 256, blocks: int = 2, rows: int = 8):
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(d) for _ in range(blocks)]).eval()
    return net, trace(net, torch.randn(rows, d), tracers=("hooks",))


def test_every_op_of_the_forward_is_priced_not_only_gemms():
    _, g = _traced()
    cm = CostModel(g, get_profile("h100"), batch_size=65536)
    bd = cm.breakdown(Policy(default="fp32"))
    # per block: layer_norm, gelu, add are memory-bound kernels next to the two GEMMs
    assert bd.parts["other"] > 0.2 * bd.total_s
    assert bd.kernels == 2 * (2 + 3)
    assert sum(bd.parts.values()) == pytest.approx(bd.total_s)
    assert sum(bd.by_module.values()) == pytest.approx(bd.total_s)


def test_cuda_layer_norm_runs_fp32_and_the_next_gemm_casts_its_output():
    """Under CUDA autocast layer_norm is on the fp32 list: its output is fp32, so fc1 casts
    it; on a CPU target layer_norm keeps the low dtype (the cast moves before it)."""
    _, g = _traced(blocks=1)
    cuda = CostModel(g, get_profile("h100"), batch_size=1024)
    cpu = CostModel(g, get_profile("h100"), batch_size=1024, device_type="cpu")
    pol = Policy(default="bf16")
    # CUDA: x -> fc1 gets LN's fp32 output (cast), fc2 gets bf16 gelu (no cast): 1 cast
    assert cuda.breakdown(pol).casts == 1
    assert cuda.breakdown(pol).weight_casts == 4  # 2 weights + 2 biases, every call
    # CPU: layer_norm runs on fp32 input x as is (it is not lowered); same count here
    assert cpu.breakdown(pol).casts == 1


def test_regions_share_a_precision_islands_cast_in_and_out():
    _, g = _traced(blocks=2)
    cm = CostModel(g, get_profile("h100"), batch_size=65536)
    leaves = [f"{b}.{n}" for b in ("0", "1") for n in ("fc1", "fc2")]
    islands = cm.breakdown(Policy(default="fp32", layers={k: "bf16" for k in leaves}))
    region = cm.breakdown(Policy(default="bf16"))
    assert islands.casts > 2 * region.casts  # every lowered leaf casts in and back out
    assert region.total_s < islands.total_s
    # a fp16 exception inside a bf16 region: autocast casts its bf16 input once; its fp16
    # output meets the fp32 residual in an add (no cast): one more cast, not two
    one = cm.breakdown(Policy(default="bf16", layers={"0.fc2": "fp16"}))
    assert one.casts == region.casts + 1


def test_batch_size_scales_activations_not_weights():
    _, g = _traced()
    small = CostModel(g, get_profile("h100"), batch_size=8)
    big = CostModel(g, get_profile("h100"), batch_size=8 * 1024)
    ks = dict(small.kernels({}))
    kb = dict(big.kernels({}))
    w = 256 * 256 * 4 + 256 * 4  # one Linear's fp32 weight and bias
    act = 8 * 256 * 4 * 2  # its input and output at 8 rows
    assert ks["0.fc1"].bytes == pytest.approx(w + act)
    assert kb["0.fc1"].bytes == pytest.approx(w + act * 1024)
    assert kb["0.fc1"].flops == pytest.approx(1024 * ks["0.fc1"].flops)


def test_vectorised_prices_equal_single_estimates_and_are_fast():
    _, g = _traced(d=64, blocks=25)  # 50 GEMMs, 150 other ops
    cm = CostModel(g, get_profile("h100"), batch_size=8)
    leaves = [n.path for n in g.gemm_nodes]
    rules = cm.rules(leaves)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 4, size=(2000, 1 + len(leaves)))
    t0 = time.perf_counter()
    got = cm.price(rules, codes).time
    per_second = len(codes) / (time.perf_counter() - t0)
    from autoprec.formats.precisions import PRECISIONS

    for i, row in enumerate(codes[:5]):
        layers = {p: PRECISIONS[c] for p, c in zip(leaves, row[1:], strict=True)}
        assert cm.estimate(layers, PRECISIONS[row[0]]) == pytest.approx(got[i], rel=1e-12)
    assert per_second > 1000, per_second
