"""The probes flag hand-built layers whose failure mode is known (see conftest.Known)."""

from __future__ import annotations

import math

import pytest

from tests.probe.probe_models import Known


def test_fp16_overflow_is_a_hard_exclusion_with_the_max(known_table):
    hard = known_table.hard_excluded()
    r = known_table.row("big", "fp16")
    assert r.hard and r.overflow > 0 and r.out_overflow > 0
    assert r.max_abs > 65504
    assert "fp16: overflow, max|y|" in r.reason and "> 65504" in r.reason
    assert ("big", "fp16") in hard and hard[("big", "fp16")] == r.reason
    assert r.nonfinite > 0 and math.isinf(r.local_error)
    assert math.isinf(known_table.estimate("big", "fp16"))
    # bf16 and tf32 have fp32's exponent range: the same values fit.
    for p in ("bf16", "tf32"):
        assert not known_table.row("big", p).hard
        assert known_table.row("big", p).overflow == 0


def test_fp16_underflow_is_flagged(known_table):
    r = known_table.row("tiny", "fp16")
    assert r.hard
    assert r.w_underflow_frac > 0.9 and r.out_underflow_frac > 0.9
    assert "fp16: underflow" in r.reason
    assert r.local_error > 0.5  # flushed to (almost) zero
    for p in ("bf16", "tf32"):
        row = known_table.row("tiny", p)
        assert not row.hard and row.underflow_frac == 0.0 and row.local_error < 0.01


def test_offset_signal_lost_in_bf16_kept_in_fp16(known_table):
    bf16, fp16 = known_table.row("offset", "bf16"), known_table.row("offset", "fp16")
    # The Linear's own output barely changes (the 64 offset dominates its norm) ...
    assert bf16.local_error < 0.01
    # ... but after the LayerNorm bf16's rounding is ~8x the fp16 error, and far larger
    # than the local error: the estimate sees the amplification, as the e2e run does.
    assert bf16.e2e_error > 5 * fp16.e2e_error
    assert bf16.cheap_estimate > 5 * fp16.cheap_estimate
    assert bf16.e2e_error > 4 * bf16.local_error
    assert bf16.e2e_error > 0.01 and fp16.e2e_error < 0.01  # around the default budget
    assert "bf16: e2e error" in bf16.reason and "amplified" in bf16.reason
    assert fp16.reason == "" and not fp16.hard and not bf16.hard  # soft, for the search


def test_robust_layer_is_clean_everywhere(known_table):
    for p in ("tf32", "bf16", "fp16", "fp8"):
        r = known_table.row("robust", p)
        assert not r.hard, r.reason
        assert r.overflow == 0 and r.nonfinite == 0 and r.underflow_frac < 0.05
    for p in ("tf32", "bf16", "fp16"):
        assert known_table.row("robust", p).reason == ""
        assert known_table.row("robust", p).e2e_error < 0.01


def test_estimates_track_measured_errors(known_table):
    pairs = [r for r in known_table if r.allowed and not r.hard]
    for r in pairs:
        assert r.estimate_method == "jacobian"
        # first order, averaged over 32 samples: within 2x of the measured error
        assert r.e2e_output_error / 2 < r.cheap_estimate < 2 * r.e2e_output_error, r
    # estimate(): the measured value when there is one, else the cheap one
    r = known_table.row("robust", "bf16")
    assert known_table.estimate("robust", "bf16") == r.e2e_output_error
    assert known_table.estimate("robust", "bf16", measured=False) == r.cheap_estimate
    assert known_table.estimate("robust", "fp32") == 0.0


def test_local_error_matches_a_hand_computation(known_table, known_batches):
    import torch

    model = Known().eval()
    err, ref = 0.0, 0.0
    with torch.no_grad():
        for x in known_batches:
            y = model.robust(x)
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                low = model.robust(x).float()
            err += float((low - y).pow(2).sum())
            ref += float(y.pow(2).sum())
    assert known_table.row("robust", "bf16").local_error == pytest.approx(
        math.sqrt(err / ref), rel=1e-6)
    assert known_table.row("robust", "bf16").calls == len(known_batches)
