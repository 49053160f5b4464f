"""Compile mode (cost/compiled.py): extern GEMMs + fused segments, by hand and against inductor."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from autoprec.cost import CostModel, get_profile
from autoprec.cost.calibrate import gemm_graph
from autoprec.cost.compiled import CompiledPricer
from autoprec.cost.model import make_cost_model
from autoprec.cost.op_pricing import EagerPricer
from autoprec.errors import InputError
from autoprec.policy import Policy
from autoprec.trace import trace
from tests.cost.graphs import TOY

L = 1e-6  # TOY launch overhead


def test_bf16_gemm_by_hand_casts_fuse_into_one_kernel():
    g = gemm_graph(1000, 1000, 1000)
    gemm = 2e9 / 4e12 + L  # 2 B x 3e6 bytes of operands hide under 0.5 ms of FLOPs
    # one fused kernel before the GEMM: read x and w in fp32, write both in bf16
    casts = 1e6 * (4 + 2) * 2 / 1e11
    cpu_like = CostModel(g, TOY, horizontal=True, mode="compile")
    assert cpu_like.estimate(Policy(default="bf16")) == pytest.approx(gemm + casts + L)
    triton = CostModel(g, TOY, horizontal=False, mode="compile")  # a weight cast is its own kernel
    assert triton.estimate(Policy(default="bf16")) == pytest.approx(gemm + casts + 2 * L)
    frozen = CostModel(g, TOY, horizontal=True, frozen=True, mode="compile")  # weight cast folded
    assert frozen.estimate(Policy(default="bf16")) == pytest.approx(gemm + casts / 2 + L)
    # eager: the same bytes, one launch per cast
    assert CostModel(g, TOY).estimate(Policy(default="bf16")) == pytest.approx(
        gemm + casts + 2 * L)
    # a bf16 leaf under a fp32 default: the output cast back to fp32 is one more segment
    exit_cast = 1e6 * (2 + 4) / 1e11 + L
    assert cpu_like.estimate({"gemm": "bf16"}) == pytest.approx(gemm + casts + L + exit_cast)


def test_fp32_plan_prices_like_eager_when_nothing_fuses():
    g = gemm_graph(64, 128, 256)
    assert CostModel(g, TOY, mode="compile").estimate({}) == pytest.approx(CostModel(g, TOY).estimate({}))


class Chain(nn.Module):
    """fc1 | GELU | fc2 | add + LayerNorm: the segments the kernel counts below are worked
    from (post-norm, unlike test_cost_model.Block)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (8, 64)
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


def _graph(model: nn.Module, x: torch.Tensor):
    return trace(model.eval(), x)


def test_pointwise_and_casts_between_gemms_are_one_kernel_per_segment():
    g = _graph(Chain(), torch.randn(8, 64))
    cpu = get_profile("cpu")
    comp, eager = CostModel(g, cpu, mode="compile"), CostModel(g, cpu)
    # fp32: fc1 (addmm) | GELU | fc2 (addmm) | add + LayerNorm
    assert comp.breakdown(Policy(default="fp32")).kernels == 2 + 2
    # bf16: the casts join the segments: [x, w1, b1 casts] fc1 [GELU, w2, b2] fc2 [add, LN]
    bd = comp.breakdown(Policy(default="bf16"))
    assert bd.kernels == 2 + 3
    assert eager.breakdown(Policy(default="bf16")).kernels > bd.kernels + 4
    # a mixed plan pays its casts' bytes, not their launches
    mixed = {"fc1": "bf16"}
    assert comp.breakdown(mixed).kernels == comp.breakdown(Policy(default="fp32")).kernels + 1
    assert comp.estimate(mixed) < eager.estimate(mixed)


class Fanout(nn.Module):
    """q, k, v projections of one LayerNorm output (autocast casts it three times)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.proj = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return sum(p(h) for p in self.proj)


def test_one_value_cast_to_one_dtype_is_cast_once():
    x = torch.randn(32, 64)
    fused = {}
    for n in (1, 3):
        cm = CostModel(_graph(Fanout(n), x), TOY, horizontal=True, mode="compile")
        fused[n] = sum(k.bytes for _, k in cm.kernels(Policy(default="bf16"))
                       if k.what == "fused")
    # 3 projections: 2 more weights cast (read fp32, write bf16) and the LayerNorm output
    # still written once in bf16 (not 3 times); the sum's running total is written after
    # one GEMM and read before the next: 6 more bf16 activation transfers
    weights = 2 * 64 * 64 * (4 + 2)
    outputs = 6 * 32 * 64 * 2
    assert fused[3] - fused[1] == pytest.approx(weights + outputs)


def test_make_cost_model_modes():
    g = gemm_graph(8, 16, 16)
    eager, compiled = make_cost_model(g, TOY), make_cost_model(g, TOY, mode="compile")
    assert isinstance(eager.forward, EagerPricer) and eager.step is None
    assert isinstance(compiled.forward, CompiledPricer) and compiled.mode == "compile"
    with pytest.raises(InputError, match="mode must be one of eager, compile"):
        make_cost_model(g, TOY, mode="jit")


def test_vectorised_prices_match_one_plan_at_a_time():
    import numpy as np

    g = _graph(Chain(), torch.randn(8, 64))
    cm = CostModel(g, get_profile("cpu"), mode="compile")
    rs = cm.rules(["fc1", "fc2", "norm"])
    codes = np.array([[0, -1, -1, -1], [2, -1, -1, -1], [0, 2, 3, -1], [2, 0, -1, 0],
                      [3, 2, -1, -1]])
    many = cm.price(rs, codes).time
    names = {0: "fp32", 2: "bf16", 3: "fp16"}
    for row, want in zip(codes, many, strict=True):
        layers = {p: names[int(c)] for p, c in zip(["fc1", "fc2", "norm"], row[1:],
                                                   strict=True) if c >= 0}
        assert cm.estimate(layers, names[int(row[0])]) == pytest.approx(want)


def _script():
    return importlib.import_module("benchmarks.compile_cost")


def test_launch_counter_reads_the_call_function():
    code = ("def call(args):\n    cpp_fused_gelu_0(buf1)\n"
            "    extern_kernels.addmm(a, b, c, out=buf2)\n"
            "    buf3 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q)\n"
            "    buf4 = torch.ops.aten.view.default(buf3, [8])\n    return (buf2, )\n")
    assert _script().launches(code) == {"fused": 1, "extern": 1, "fallback": 1}


def test_fused_bytes_reads_buffer_sizes_and_dtypes_from_the_call_function():
    code = ("def call(self, args):\n"
            "        assert_size_stride(arg0_1, (64, 64), (64, 1), 'input')\n"
            "        buf0 = empty_strided_cpu((64, 64), (64, 1), torch.bfloat16)\n"
            "        cpp_fused__to_copy_0(arg0_1, buf0)\n"
            "        buf1 = empty_strided_cpu((64, 8), (8, 1), torch.float32)\n"
            "        extern_kernels.mm(buf0, buf0, out=buf1)\n"
            "        buf2 = buf1; del buf1  # reuse\n"
            "        cpp_fused_gelu_1(buf2)\n"
            "        return (buf2, )\n")
    # to_copy: 64*64 fp32 read + 64*64 bf16 written; gelu: the reused 64*8 fp32 buffer once
    assert _script().fused_bytes(code) == 64 * 64 * 4 + 64 * 64 * 2 + 64 * 8 * 4


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
def test_priced_kernels_match_what_inductor_launches():
    from autoprec.apply.apply import apply_policy

    mod = _script()
    net, x = Chain().eval(), torch.randn(8, 64)
    cm = CostModel(_graph(net, x), get_profile("cpu"), mode="compile")
    for pol in (Policy(default="fp32"), Policy(default="bf16"),
                Policy(default="fp32", layers={"fc2": "bf16"})):
        with torch.no_grad(), apply_policy(net, pol, target="cpu"):
            _, counts, _ = mod.compile_and_count(net, lambda c: c(x))
        assert sum(counts.values()) == cm.breakdown(pol).kernels, pol
