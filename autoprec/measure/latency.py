"""Measured mode: the wall time of a callable on a device.

GPU: CUDA events around each run on the current stream, after ``warmup`` runs (the
first calls pay cuBLAS heuristics, autotuning and allocator growth); the events are read
after one final synchronize, so timing adds no host syncs between runs. CPU: the median
of repeated ``time.perf_counter`` wall-clock runs after the warm-up.

``clock="thread"`` (CPU only) times with ``time.thread_time``, the CPU time of the calling
thread: on a shared, oversubscribed machine it ignores the time the thread sat
descheduled. It measures the whole run only when torch computes in the calling thread,
i.e. after ``torch.set_num_threads(1)`` (checked).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoprec.device.targets import device_kind, is_cpu
from autoprec.errors import CapabilityError, InputError


@dataclass(frozen=True)
class Timing:
    """Seconds per run: median and 10th/90th percentiles over ``n`` timed runs."""

    median_s: float
    p10: float
    p90: float
    n: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the run-to-run noise of this measurement."""
        return (self.p90 - self.p10) / self.median_s if self.median_s > 0 else 0.0

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        a = np.asarray(samples, dtype=float)
        p10, med, p90 = np.percentile(a, [10, 50, 90])
        return cls(float(med), float(p10), float(p90), len(samples))


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise InputError(f"`warmup >= 0` must hold, but got warmup={warmup}")
    if repeats < 1:
        raise InputError(f"`repeats >= 1` must hold, but got repeats={repeats}")


def measure_latency(
    run: Callable[[], Any],
    device: str = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    clock: str = "wall",
) -> Timing:
    """Time ``run()`` on ``device`` ("cpu", "cuda", "cuda:1"); see the module docstring."""
    _check_counts(warmup, repeats)
    if clock not in ("wall", "thread"):
        raise InputError(f"measure_latency: clock must be 'wall' or 'thread', got {clock!r}")
    if not is_cpu(device_kind(device, "measure_latency")):
        if clock != "wall":
            raise InputError("measure_latency: clock='thread' is for the CPU only")
        return _measure_cuda(run, device, warmup, repeats)
    if clock == "thread":
        import torch

        if torch.get_num_threads() != 1:
            raise InputError("measure_latency: clock='thread' needs torch.set_num_threads(1), "
                             f"but torch uses {torch.get_num_threads()} threads")
    now = time.thread_time if clock == "thread" else time.perf_counter
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        t0 = now()
        run()
        samples.append(now() - t0)
    return Timing.from_samples(samples)


def _measure_cuda(run: Callable[[], Any], device: str, warmup: int, repeats: int) -> Timing:
    import torch

    if not torch.cuda.is_available():
        raise CapabilityError(f"{device}: no CUDA device (torch {torch.__version__}, "
                              f"torch.cuda.is_available() is False)")
    with torch.cuda.device(torch.device(device)):
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for s, e in zip(starts, ends, strict=True):
            s.record()
            run()
            e.record()
        torch.cuda.synchronize()
        # elapsed_time is in milliseconds
        return Timing.from_samples([s.elapsed_time(e) / 1e3
                                    for s, e in zip(starts, ends, strict=True)])


def measure_interleaved(
    runs: Mapping[str, Callable[[], Any]],
    device: str = "cpu",
    *,
    around: Mapping[str, Callable[[], AbstractContextManager[Any]]] | None = None,
    rounds: int = 7,
    max_rounds: int | None = None,
    more: Callable[[Mapping[str, list[float]]], bool] | None = None,
    time_budget_s: float = 60.0,
    warmup: int = 1,
    inner: int = 1,
    clock: str = "wall",
    seed: int = 0,
    before_each: Callable[[], Any] | None = None,
) -> Samples:
    """Seconds per run of every entry of ``runs``, one sample per round (on a CPU with the
    minor page faults per run of each sample: ``Samples.faults``).

    Each round runs every entry once, in a fresh random order (slow drift of a shared
    machine then hits all alike, and ratios of one round cancel it): ``around[name]()`` is
    entered untimed (e.g. ``apply_policy``), ``warmup`` runs, then ``inner`` timed runs
    (their mean is the sample; ``before_each()``, if given, runs untimed before each of
    them, on a CPU only). After ``rounds`` rounds, more follow while ``more(samples)``
    says so, up to ``max_rounds`` and ``time_budget_s`` wall seconds. CPU clocks as in
    ``measure_latency``; on CUDA, events around the inner runs.
    """
    import random

    _check_counts(warmup, rounds)
    if inner < 1:
        raise InputError(f"`inner >= 1` must hold, but got inner={inner}")
    cpu = is_cpu(device_kind(device, "measure_interleaved"))
    if clock == "thread" and not cpu:
        raise InputError("measure_interleaved: clock='thread' is for the CPU only")
    around = around or {}
    rng = random.Random(seed)
    names = list(runs)
    samples = Samples({n: [] for n in names})
    if cpu:
        samples.faults = {n: [] for n in names}
    start = time.perf_counter()
    cap = max(rounds, max_rounds or rounds)
    for r in range(cap):
        if r >= rounds and (more is None or not more(samples)
                            or time.perf_counter() - start > time_budget_s):
            break
        rng.shuffle(names)
        for name in names:
            ctx = around.get(name)
            with ctx() if ctx is not None else nullcontext():
                sec, faults = _sample(runs[name], device, warmup, inner, clock, before_each)
            samples[name].append(sec)
            if faults is not None:
                samples.faults[name].append(faults)
    return samples


class Samples(dict[str, list[float]]):
    """``measure_interleaved``'s seconds per run by entry, one per round. ``faults``: on a
    CPU, by entry, the minor page faults per run in each of those samples: the first
    touches of memory the allocator got fresh from the OS (glibc hands a large freed
    buffer back and maps a new one for the next, each 4 KiB page faulting on first touch),
    which the same forward may pay in one process and not in another."""

    faults: dict[str, list[float]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = {}


def allocator_trim() -> Callable[[], Any] | None:
    """glibc's ``malloc_trim(0)`` as a call: it hands every free page of the heap back to
    the OS, so the next large allocations start on fresh pages that fault on first touch
    (None where the C library has no such call)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


def _minor_faults() -> int:
    """This thread's minor page faults so far (Linux; the process's elsewhere)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _sample(run: Callable[[], Any], device: str, warmup: int, inner: int, clock: str,
            before_each: Callable[[], Any] | None = None) -> tuple[float, float | None]:
    """Seconds per run of ``inner`` timed runs after ``warmup`` untimed ones, and on a CPU
    their minor page faults per run (``before_each`` untimed before each timed run)."""
    for _ in range(warmup):
        run()
    if not is_cpu(device):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(inner):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / inner, None  # elapsed_time: milliseconds
    now = time.thread_time if clock == "thread" else time.perf_counter
    if before_each is not None:
        sec, faults = 0.0, 0
        for _ in range(inner):
            before_each()
            f0 = _minor_faults()
            t0 = now()
            run()
            sec += now() - t0
            faults += _minor_faults() - f0
        return sec / inner, faults / inner
    f0 = _minor_faults()
    t0 = now()
    for _ in range(inner):
        run()
    sec = (now() - t0) / inner
    return sec, (_minor_faults() - f0) / inner


__all__ = ["Samples", "Timing", "allocator_trim", "measure_interleaved", "measure_latency"]
