"""``lower/wide16``: 16-bit GEMMs scored as a GPU computes them, on a CPU without kernels.

The wide result must be the GEMM of the very same 16-bit operands accumulated in fp32 and
rounded once to the 16-bit dtype: computed here independently in fp64 (exact products and
sums for these sizes, then one rounding), so a wrong upcast, a missing rounding or a
dtype leak fails. The audit must still see a 16-bit GEMM under it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoprec.lower.wide16 import Wide16, scoring_gemms, slow_dtypes


@pytest.fixture(autouse=True)
def _fresh_switch():
    """``slow_dtypes`` is cached per process: cleared around each test that sets it."""
    slow_dtypes.cache_clear()
    yield
    slow_dtypes.cache_clear()


def _ints(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every product and sum is exact in fp32 and in fp64, so the wide GEMM
    and the fp64 one round the same exact value."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(-8, 8, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "linear", "conv2d"])
def test_a_wide_gemm_is_the_fp32_accumulated_gemm_rounded_once(op: str, dtype: torch.dtype):
    a, b = _ints(2, 5, 7, dtype=dtype), _ints(2, 7, 3, dtype=dtype)
    bias = _ints(3, dtype=dtype)
    x, w = _ints(1, 2, 6, 6, dtype=dtype), _ints(4, 2, 3, 3, dtype=dtype)
    calls = {
        "mm": lambda t: torch.mm(t(a[0]), t(b[0])),
        "addmm": lambda t: torch.addmm(t(bias), t(a[0]), t(b[0])),
        "bmm": lambda t: torch.bmm(t(a), t(b)),
        "baddbmm": lambda t: torch.baddbmm(t(bias), t(a), t(b)),
        "linear": lambda t: F.linear(t(a[0]), t(b[0]).T, t(bias)),
        "conv2d": lambda t: F.conv2d(t(x), t(w), t(bias[:1]).expand(4).contiguous()),
    }
    expect = calls[op](lambda t: t.double()).to(dtype)  # exact, rounded once
    mode = Wide16(frozenset({dtype}))
    with mode:
        got = calls[op](lambda t: t)
    assert got.dtype == dtype
    assert mode.calls >= 1
    assert torch.equal(got, expect)


def test_a_value_past_fp16_range_overflows_as_on_a_gpu():
    """fp32 accumulation, then the fp16 rounding: 300 * 300 = 90000 > 65504 is inf."""
    a = torch.full((1, 1), 300.0, dtype=torch.float16)
    with Wide16(frozenset({torch.float16})):
        assert torch.isinf(torch.mm(a, a)).all()
        # an intermediate sum past the range that comes back within it stays finite
        # (fp32 accumulation), as cuBLAS computes it
        x = torch.tensor([[300.0, 300.0]], dtype=torch.float16)
        y = torch.tensor([[300.0], [-300.0]], dtype=torch.float16)
        assert torch.mm(x, y).item() == 0.0


def test_other_dtypes_and_mixed_operands_run_unchanged():
    mode = Wide16(frozenset({torch.float16}))
    a = torch.randn(4, 4)
    with mode:
        assert torch.equal(torch.mm(a, a), a @ a)  # fp32: not touched
        torch.mm(a.bfloat16(), a.bfloat16())  # bf16 not in the set
    assert mode.calls == 0


def test_the_audit_still_sees_a_16bit_gemm_under_it(monkeypatch: pytest.MonkeyPatch):
    """The audit's recorder is entered after Wide16: it records fp16, then Wide16 runs it."""
    from autoprec.apply.apply import audit_policy
    from autoprec.policy import Policy

    monkeypatch.setenv("AUTOPREC_WIDE16", "0")  # only this test's mode: its count is read

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with Wide16(frozenset({torch.float16})) as mode:
        report = audit_policy(net, Policy(default="fp32", layers={"2": "fp16"}),
                              lambda: net(x))
    assert report.ok, report.errors
    assert {r.layer: r.computed for r in report.rows} == {"0": "fp32", "2": "fp16"}
    assert mode.calls >= 1


def test_the_switch_follows_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AUTOPREC_WIDE16", "0")
    assert slow_dtypes() == frozenset()
    with scoring_gemms() as mode:
        assert mode is None
    slow_dtypes.cache_clear()
    monkeypatch.setenv("AUTOPREC_WIDE16", "1")
    with scoring_gemms() as mode:
        assert isinstance(mode, Wide16)
        torch.mm(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
    assert mode.calls == 1


def test_this_cpu_is_measured_when_nothing_forces_it(monkeypatch: pytest.MonkeyPatch):
    """Unforced, the set is what this CPU measures: a dtype is in it only when its matmul
    is slower than fp32's by the factor (checked against a timing taken here)."""
    from autoprec.lower import wide16

    monkeypatch.delenv("AUTOPREC_WIDE16", raising=False)
    got = slow_dtypes()
    assert got <= set(wide16.HALF_DTYPES)
    fp32 = min(wide16._matmul_s(torch.float32) for _ in range(3))
    for d in wide16.HALF_DTYPES:
        t = min(wide16._matmul_s(d) for _ in range(3))
        if t > 4 * wide16.SLOW_FACTOR * fp32:  # far past the bar: timing noise cannot flip it
            assert d in got
        elif t < fp32 / 2:
            assert d not in got


def test_a_large_right_operand_is_computed_in_pieces_with_the_same_numbers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An LM head's GEMM upcasts its weight in pieces of columns (not a 2 GB fp32 copy of an
    8 B Llama's head): the outputs are those of the one fp32 GEMM."""
    import autoprec.lower.wide16 as w16

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 256, generator=g).bfloat16()
    weight = torch.randn(1000, 256, generator=g).bfloat16()
    bias = torch.randn(1000, generator=g).bfloat16()
    with w16.Wide16(frozenset({torch.bfloat16})) as whole:
        want = [F.linear(x, weight), F.linear(x, weight, bias)]
    monkeypatch.setattr(w16, "PIECE", 256 * 100)  # 100 columns a piece
    with w16.Wide16(frozenset({torch.bfloat16})) as pieces:
        got = [F.linear(x, weight), F.linear(x, weight, bias)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert pieces.calls > 10 * whole.calls  # 10 pieces each
