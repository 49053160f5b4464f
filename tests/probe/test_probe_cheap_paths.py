"""The gradient probes' cheap paths give the numbers of the direct computation: one
nonzero mask per gradient for every (precision, scale), one pass for the backward's error
when every value is finite, one product g·δ for every split of the estimate."""

from __future__ import annotations

import math

import pytest
import torch

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
