"""Which targets are this machine, its calibration cache, and interleaved timing."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from autoprec.cost import Calibration, get_profile
from autoprec.errors import InputError
from autoprec.measure import measure_interleaved
from autoprec.measure.machine import (
    cached_calibration,
    calibration_path,
    local_device,
    this_machine,
    timing_threads,
)
from autoprec.pricing.speed_source import speed_source


def test_the_cpu_target_is_local_and_a_gpu_profile_is_not_on_a_cpu_machine():
    dev, why = local_device(get_profile("cpu"))
    assert dev == "cpu" and "this machine's CPU" in why
    if not torch.cuda.is_available():
        dev, why = local_device(get_profile("h100"))
        assert dev is None and "no h100 here" in why and "not measured" in why


def test_machine_facts_name_the_cpu_features_and_torch():
    m = this_machine("cpu")
    assert m.device == "cpu" and m.torch == str(torch.__version__) and m.threads == 1
    assert set(m.features) <= {"amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16",
                               "avx512_fp16", "avx512f"}
    assert len(m.key) == 12 and m.key == this_machine("cpu").key
    other = dataclasses.replace(m, features=("amx_bf16",) if "amx_bf16" not in m.features
                                else ())
    assert other.key != m.key  # another CPU kind: another cache entry
    with pytest.raises(InputError, match="unknown device"):
        this_machine("tpu")


def test_a_cached_calibration_is_used_only_on_the_machine_that_measured_it(tmp_path: Path):
    prof, m = get_profile("cpu"), this_machine("cpu")
    assert cached_calibration(tmp_path, prof, m) is None
    cal = Calibration(device="cpu", efficiency={"bf16": 0.2}, n_samples=3,
                      machine=m.to_dict())
    cal.save(calibration_path(tmp_path, prof, m))
    got = cached_calibration(tmp_path, prof, m)
    assert got is not None and got.efficiency == {"bf16": 0.2}
    # a file under this machine's name written for other facts is not trusted
    other = dataclasses.replace(cal, machine={**m.to_dict(), "torch": "0.0"})
    other.save(calibration_path(tmp_path, prof, m))
    assert cached_calibration(tmp_path, prof, m) is None
    calibration_path(tmp_path, prof, m).write_text("not: [yaml")
    assert cached_calibration(tmp_path, prof, m) is None


def test_speed_source_prices_a_local_target_on_this_machines_cache(tmp_path: Path):
    prof, m = get_profile("cpu"), this_machine("cpu")
    # no cache, no measuring: the stored profile, named as another machine's
    src = speed_source("cpu", measure=False, cache_dir=tmp_path)
    assert src.how == "stored profile" and src.local and "another machine" in src.note
    assert src.provenance()["speed_note"].startswith("stored cpu profile")
    Calibration(device="cpu", efficiency={"bf16": 0.2}, machine=m.to_dict()).save(
        calibration_path(tmp_path, prof, m))
    src = speed_source("cpu", measure=False, cache_dir=tmp_path)
    assert src.how == "cached calibration"
    assert src.profile.efficiency["bf16"] == pytest.approx(0.2)
    remote = speed_source("h100", measure=True, cache_dir=tmp_path)
    if not torch.cuda.is_available():
        assert not remote.local and remote.how == "stored profile"


def test_a_fresh_calibration_prices_as_its_cache_reads_back(tmp_path: Path):
    """The run that calibrates and every later run (which reads the cached, rounded file)
    price on one profile: the same figures, the same study name (``--resume`` joins)."""
    fresh = speed_source("cpu", measure=True, cache_dir=tmp_path)
    assert fresh.how == "calibrated here"
    cached = speed_source("cpu", measure=True, cache_dir=tmp_path)
    assert cached.how == "cached calibration"
    assert fresh.profile.to_dict() == cached.profile.to_dict()


def test_measure_interleaved_runs_every_entry_once_per_round_inside_its_context():
    entered: list[str] = []
    calls: dict[str, int] = {"a": 0, "b": 0}

    @contextmanager
    def ctx(name):
        entered.append(name)
        yield

    runs = {n: (lambda n=n: calls.__setitem__(n, calls[n] + 1)) for n in calls}
    out = measure_interleaved(runs, around={n: (lambda n=n: ctx(n)) for n in calls},
                              rounds=3, warmup=1, inner=2)
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3}
    assert calls == {"a": 9, "b": 9}  # (1 warm-up + 2 timed) x 3 rounds
    assert sorted(entered) == ["a"] * 3 + ["b"] * 3
    more = iter([True, True, False])
    out = measure_interleaved(runs, rounds=2, max_rounds=10, more=lambda s: next(more))
    assert len(out["a"]) == 4  # 2 rounds, then 2 more while asked
    with pytest.raises(InputError, match="inner >= 1"):
        measure_interleaved(runs, inner=0)


def test_timing_threads_uses_one_cpu_thread_and_restores():
    before = torch.get_num_threads()
    with timing_threads("cpu"):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_a_compile_calibration_is_cached_apart_and_carries_the_call_overhead(tmp_path: Path):
    prof, m = get_profile("cpu"), this_machine("cpu")
    eager = calibration_path(tmp_path, prof, m)
    compiled = calibration_path(tmp_path, prof, m, "compile")
    assert eager != compiled and "-compile-" in compiled.name
    Calibration(device="cpu", efficiency={"bf16": 0.3}, machine=m.to_dict(), mode="compile",
                call_overhead_s=80e-6).save(compiled)
    # the compiled one is not the eager one: an eager tune finds nothing cached
    assert cached_calibration(tmp_path, prof, m) is None
    # a file of the other mode under this name is not trusted
    Calibration(device="cpu", efficiency={"bf16": 0.2}, machine=m.to_dict()).save(compiled)
    assert cached_calibration(tmp_path, prof, m, "compile") is None
    Calibration(device="cpu", efficiency={"bf16": 0.3}, machine=m.to_dict(), mode="compile",
                call_overhead_s=80e-6).save(compiled)
    src = speed_source("cpu", measure=False, cache_dir=tmp_path, mode="compile")
    assert src.how == "cached calibration" and "compiled micro-benchmarks" in src.note
    assert src.profile.mode == "compile"
    assert src.profile.call_overhead_s == pytest.approx(80e-6)
    # the compiled cost model prices the call's own time once per forward
    from autoprec.cost import CostModel
    from autoprec.trace import trace

    net = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    graph = trace(net, torch.randn(2, 8))
    with_call = CostModel(graph, src.profile, mode="compile").estimate({})
    without = CostModel(graph, src.profile, call_overhead_s=0.0, mode="compile").estimate({})
    assert with_call - without == pytest.approx(80e-6)


def test_a_calibration_file_with_an_unknown_mode_is_refused(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("autoprec_calibration: 1\ndevice: cpu\nmode: jit\n")
    from autoprec.cost import load_calibration

    with pytest.raises(InputError, match="mode: expected 'eager' or 'compile', got 'jit'"):
        load_calibration(path)


def test_measure_interleaved_counts_the_page_faults_of_fresh_memory_per_run():
    """A run that maps fresh pages and touches them faults once per page, every run; one
    that reuses its buffer does not (``Samples.faults``: per run, per sample)."""
    import mmap

    pages = 256

    def fresh() -> None:
        m = mmap.mmap(-1, pages * mmap.PAGESIZE)
        for off in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
            m[off] = 1
        m.close()

    buf = bytearray(pages * mmap.PAGESIZE)

    def reuse() -> None:
        buf[::mmap.PAGESIZE] = b"\x01" * pages

    out = measure_interleaved({"fresh": fresh, "reuse": reuse}, rounds=3, inner=2)
    assert len(out.faults["fresh"]) == len(out["fresh"]) == 3
    assert all(f >= pages for f in out.faults["fresh"])
    assert all(f < pages / 10 for f in out.faults["reuse"])


def test_a_trimmed_allocator_serves_a_freed_buffer_from_fresh_pages_again():
    """``allocator_trim`` before each timed run (the cold confirmation's timing): a run that
    allocates and frees an 8 MB tensor faults on its fresh pages in every run (here once
    per 8 KiB: 1,024 faults; without the trim, after the first run, none)."""
    import mmap

    from autoprec.measure.latency import allocator_trim

    trim = allocator_trim()
    if trim is None:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    n = 8 << 20

    def run() -> None:
        torch.empty(n, dtype=torch.uint8).fill_(1)

    out = measure_interleaved({"alloc": run}, rounds=3, inner=2, before_each=trim)
    assert all(f >= n / mmap.PAGESIZE / 4 for f in out.faults["alloc"])

