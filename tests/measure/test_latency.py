"""measure_latency: CPU wall/thread clocks, argument checks, CUDA gating."""

from __future__ import annotations

import time

import pytest
import torch

from autoprec.errors import CapabilityError, InputError
from autoprec.measure import Timing, measure_latency


def test_cpu_timing_counts_and_orders_percentiles():
    calls = []

    def run():
        calls.append(1)
        time.sleep(0.002)

    t = measure_latency(run, "cpu", warmup=2, repeats=5)
    assert isinstance(t, Timing) and t.n == 5 and len(calls) == 7
    assert 0.002 <= t.p10 <= t.median_s <= t.p90
    assert t.spread >= 0


def test_thread_clock_ignores_sleep_and_needs_one_thread():
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t = measure_latency(lambda: time.sleep(0.01), "cpu", 0, 3, clock="thread")
        assert t.median_s < 0.005  # sleeping costs no CPU time
        torch.set_num_threads(2)
        with pytest.raises(InputError, match="set_num_threads"):
            measure_latency(lambda: None, "cpu", 0, 1, clock="thread")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kwargs, match", [
    ({"repeats": 0}, "repeats >= 1"),
    ({"warmup": -1}, "warmup >= 0"),
    ({"clock": "gpu"}, "clock must be"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(InputError, match=match):
        measure_latency(lambda: None, "cpu", **kwargs)


def test_unknown_device():
    with pytest.raises(InputError, match="unknown device 'tpu'"):
        measure_latency(lambda: None, "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_without_cuda_is_capability_error():
    with pytest.raises(CapabilityError, match="no CUDA device"):
        measure_latency(lambda: None, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="cuda: torch.cuda.is_available() is False")
def test_cuda_events_time_a_matmul():
    a = torch.randn(1024, 1024, device="cuda")
    t = measure_latency(lambda: a @ a, "cuda", warmup=2, repeats=5)
    assert t.n == 5 and 0 < t.median_s < 1
