"""autoprec.tuning.memory: per-stage peaks, handing freed memory back, the mmap threshold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autoprec.tuning import memory
from autoprec.tuning.memory import StagePeaks, map_large_allocations, release_freed

LINUX = sys.platform.startswith("linux") and memory.CLEAR_REFS.exists()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not LINUX, reason="VmHWM reset needs Linux /proc/self/clear_refs")
def test_each_stage_has_its_own_peak() -> None:
    """A stage that allocates 256 MB peaks ~256 MB above the next, which allocates little:
    the counter is reset per stage (ru_maxrss would give both the first stage's peak)."""
    peaks = StagePeaks()
    with peaks.stage("big"):
        t = torch.ones(64 * 1024 * 1024)  # 256 MB, touched
        del t
    with peaks.stage("small"):
        u = torch.ones(1024)
        del u
    assert list(peaks.peaks) == ["load", "big", "small"]
    assert peaks.overall == max(peaks.peaks.values())
    assert peaks.resettable
    assert peaks.peaks["big"] - peaks.peaks["small"] > 200e6, peaks.peaks
    # "load" is the process's peak before the first reset: in a pytest-xdist worker that ran
    # other tests first it may top "big", so the highest stage is whichever is largest
    assert peaks.highest == max(peaks.peaks, key=peaks.peaks.get)
    assert peaks.summary().startswith("load ") and ", big " in peaks.summary()


def test_without_a_reset_the_peak_is_the_process_peak(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """Where /proc/self/clear_refs cannot be written, a stage reports ru_maxrss."""
    monkeypatch.setattr(memory, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    monkeypatch.setattr(memory._reset_hwm, "__defaults__", (memory.CLEAR_REFS,))
    peaks = StagePeaks()
    with peaks.stage("a"):
        pass
    assert not peaks.resettable
    assert peaks.peaks["a"] == memory.peak_bytes()[0]


@pytest.mark.skipif(memory._libc() is None, reason="malloc_trim / mallopt need glibc")
def test_release_freed_gives_heap_memory_back() -> None:
    """Many small tensors (below any mmap threshold) live on the heap; freed, glibc keeps
    the pages until malloc_trim hands them back."""
    before = _rss()
    keep = [torch.ones(8 * 1024) for _ in range(8000)]  # 8000 x 32 KB = 262 MB on the heap
    pin = [torch.ones(16) for _ in range(16)]  # above them: the heap's top is not free
    del keep
    assert release_freed() is True
    assert _rss() - before < 100e6
    del pin


@pytest.mark.skipif(memory._libc() is None, reason="mallopt needs glibc")
def test_map_large_allocations_is_accepted() -> None:
    assert map_large_allocations() is True


def test_not_glibc_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_libc", lambda: None)
    assert release_freed() is False
    assert map_large_allocations() is False


def test_each_stage_records_its_cpu_seconds_beside_its_wall_seconds():
    peaks = StagePeaks()
    with peaks.stage("busy"):
        x = torch.randn(256, 256)
        for _ in range(20):
            x = torch.tanh(x @ x)
    with peaks.stage("idle"):
        import time

        time.sleep(0.2)
    assert peaks.cpu_seconds["busy"] > 0
    assert peaks.seconds["idle"] >= 0.2 and peaks.cpu_seconds["idle"] < 0.1
