"""calibrate.fit recovers known factors from synthetic measurements."""

from __future__ import annotations

import pytest

from autoprec.cost import CostModel, Sample, fit
from autoprec.cost.calibrate import copy_graph, gemm_graph
from autoprec.errors import InputError
from tests.cost.graphs import TOY

TRUE = TOY.with_factors(efficiency={"fp32": 0.5, "bf16": 0.7, "fp8": 0.6},
                        memory_efficiency=0.8, launch_overhead_s=3e-6)
SHAPES = [(2048, 2048, 2048), (4096, 1024, 4096), (1, 4096, 4096), (8, 64, 64)]


def _samples(truth=TRUE, precisions=("fp32", "bf16", "fp8")):
    out = []
    for m, k, n in SHAPES:
        cm = CostModel(gemm_graph(m, k, n), TOY)
        for p in precisions:
            out.append(Sample(cm, {"gemm": p}, cm.with_profile(truth).estimate({"gemm": p}),
                              f"{m}x{k}x{n} {p}"))
    for elems in (1 << 24, 16):
        cm = CostModel(copy_graph(elems), TOY)
        out.append(Sample(cm, {}, cm.with_profile(truth).estimate({}), f"copy {elems}"))
    return out


def test_fit_recovers_efficiencies_bandwidth_and_launch():
    res = fit(TOY, _samples(), note="synthetic")
    cal = res.calibration
    assert cal.efficiency == pytest.approx({"fp32": 0.5, "bf16": 0.7, "fp8": 0.6}, rel=1e-3)
    assert cal.memory_efficiency == pytest.approx(0.8, rel=1e-3)
    assert cal.launch_overhead_s == pytest.approx(3e-6, rel=1e-3)
    assert cal.rel_rmse < 1e-6
    assert "tf32" not in cal.efficiency  # not measured: the profile keeps its own
    assert max(abs(e) for e in res.rel_errors) < 1e-6
    assert cal.device == "toy" and cal.n_samples == len(_samples())


def test_fit_can_hold_launch_overhead_and_fit_gemm_setup():
    truth = TRUE.with_factors(gemm_setup_s={"bf16": 2e-5},
                              launch_overhead_s=TOY.launch_overhead_s)
    res = fit(TOY, _samples(truth), fit_launch=False, fit_setup=True)
    assert res.calibration.launch_overhead_s is None  # held at the profile's value
    assert res.calibration.gemm_setup_s["bf16"] == pytest.approx(2e-5, rel=1e-3)
    assert res.calibration.gemm_setup_s["fp32"] == pytest.approx(0.0, abs=1e-9)


def test_fit_rejects_bad_samples():
    with pytest.raises(InputError, match="at least one"):
        fit(TOY, [])
    cm = CostModel(gemm_graph(4, 4, 4), TOY)
    with pytest.raises(InputError, match="seconds > 0"):
        fit(TOY, [Sample(cm, {}, 0.0, "zero")])
