"""The gradient probes' cheap paths give the numbers of the direct computation: every
(precision, scale)'s flush / overflow counts from one pass over |g| (the cast's thresholds),
one pass for the backward's error when every value is finite, one product g·δ for every
split of the estimate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from autoprec.probe.flush import cast_thresholds
from autoprec.probe.grads import SPLITS, Projections, _error_and_nonfinite, _split
from autoprec.probe.ranges import GradFlush, grad_flush


def _direct_flush(g: torch.Tensor, precision: str, scale: float) -> tuple[int, int, int]:
    nz = (g != 0) & torch.isfinite(g)
    n = int(nz.sum())
    if precision == "tf32":
        return n, 0, 0
    low = (g * scale).to(torch.float16 if precision == "fp16" else torch.bfloat16).float()
    return n, int((nz & (low == 0)).sum()), int((nz & torch.isinf(low)).sum())


@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
@pytest.mark.parametrize("scale", [1.0, 2.0**16])
def test_one_mask_counts_as_a_fresh_cast_per_precision(precision: str, scale: float) -> None:
    g = torch.randn(64, 32) * 1e-6  # many values flush in fp16 unscaled
    g[0, :4] = torch.tensor([0.0, float("inf"), float("nan"), 7e4])  # not nonzero / overflow
    counter = GradFlush(g)
    want = _direct_flush(g, precision, scale)
    assert counter.count(precision, scale) == want == grad_flush(g, precision, scale)
    if precision == "fp16":
        assert (want[1] if scale == 1.0 else want[2]) > 0  # flushes unscaled, 7e4 overflows


def _f32(x: float, toward: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(toward)))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_thresholds_are_where_the_real_cast_turns_to_zero_and_inf(precision: str) -> None:
    z, o = cast_thresholds(precision)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    assert float(np.float32(z)) == z and float(np.float32(o)) == o  # fp32 values
    # z and o themselves are ties: round to even, i.e. to 0 and to inf
    xs = torch.tensor([z, _f32(z, 1.0), _f32(o, 0.0), o], dtype=torch.float32)
    for n in (1, 4099):  # the scalar and the vectorised cast
        low = xs.repeat(n).to(dtype).float().reshape(n, 4)[-1].tolist()
        assert low[0] == 0.0 and low[1] > 0.0
        assert math.isfinite(low[2]) and math.isinf(low[3])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 2.0**40, 3.0])  # 3.0: not a power of 2
def test_one_pass_counts_equal_a_fresh_cast_at_the_edges(precision: str, scale: float) -> None:
    z, o = cast_thresholds(precision)
    edges = []
    for t in (z / scale, o / scale):  # |g| * scale on both sides of each threshold
        f = float(np.float32(t))
        edges += [f, _f32(f, 0.0), _f32(f, math.inf), -f]
    g = torch.cat([torch.randn(4000) * 10.0 ** torch.randint(-45, 38, (4000,)).float(),
                   torch.tensor(edges + [0.0, -0.0, 1e-45, -1e-45, float("inf"),
                                         float("-inf"), float("nan"), 3e38])])
    counter = GradFlush(g)
    pairs = [(p, s) for p in ("fp16", "bf16", "tf32") for s in (1.0, scale)]
    got = counter.counts(pairs)
    for p, s in pairs:
        assert got[(p, s)] == _direct_flush(g, p, s), (p, s)
    n, flushed, over = got[(precision, scale)]
    assert n > 0 and over > 0
    # both thresholds exercised, but where z / scale is below fp32's smallest value
    assert (flushed > 0) == (z / scale >= 1.4e-45)


def test_error_is_one_pass_when_finite_and_counts_non_finite_values() -> None:
    ref = [torch.randn(8, 4), torch.randn(4)]
    low = [r + 1e-3 * torch.randn_like(r) for r in ref]
    err, bad = _error_and_nonfinite(low, ref)
    assert bad == 0
    assert err == sum(float((v - r).pow(2).sum()) for v, r in zip(low, ref))
    low[1][2] = float("inf")
    low[0][0, 0] = float("nan")
    assert _error_and_nonfinite(low, ref) == (0.0, 2)
    huge = [torch.full((2,), 1e30)]  # finite values whose squared error overflows
    err, bad = _error_and_nonfinite(huge, [torch.zeros(2)])
    assert bad == 0 and math.isinf(err)


class _Call:
    def __init__(self, path: str, deltas: dict[str, list[torch.Tensor]]) -> None:
        self.layer = type("L", (), {"path": path})()
        self.deltas = deltas
        self.edges = [object()]


def test_each_split_sums_the_same_products_as_one_product_per_split() -> None:
    torch.manual_seed(0)
    g1, g2 = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    d = {p: [torch.randn(4, 6, 8)] for p in ("bf16", "fp16")}
    calls = [_Call("a", d), _Call("a", {p: [v[0] * 0.5] for p, v in d.items()})]  # called twice
    proj = Projections()
    proj.add(calls, [[g1], [g2]], weight=0.5)
    for split in SPLITS:
        for p in ("bf16", "fp16"):
            parts = [_split(g1.float() * d[p][0], split), _split(g2.float() * d[p][0] * 0.5, split)]
            want = 0.5 * float(torch.stack(parts).sum(0).pow(2).sum())
            assert proj.sq[split][("a", p)] == want
    assert proj.seen == {("a", "bf16"), ("a", "fp16")}
