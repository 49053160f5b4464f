"""torch's default AdamW step timed here, over tensors of a model's trainable parameters.

A training step ends with ``optimizer.step()``. On a CPU torch's ``AdamW`` runs, by
default, its single-tensor path (``torch/optim/adamw.py``: no ``foreach``, no ``fused``
off CUDA): per parameter ``mul_`` (decay), ``lerp_`` (exp_avg), ``mul_`` and
``addcmul_`` (exp_avg_sq), then ``exp_avg_sq.sqrt()`` and its division by the bias
correction out of place, ``add_(eps)`` and ``addcdiv_`` — a Python loop of eight ops per
tensor. Its two out-of-place temporaries are fresh allocations of the parameter's size:
above glibc's mmap threshold (32 MB at most: MiniLM's 30522 x 384 word embedding, 47 MB
in fp32) each is a new mapping whose first write page-faults, every step. A bandwidth
figure over the bytes prices neither the per-op host cost of the loop nor those faults;
measured on this repository's AMD EPYC (one thread), MiniLM's AdamW step took 72-97 ms
under the profiler against 34.5 ms priced from bytes (benchmarks/results/train_step_cpu.md).

``measure_optimizer(numels)`` builds one fp32 tensor per trainable parameter of those
sizes (flat: AdamW's ops are elementwise), with gradients, and times
``torch.optim.AdamW(params).step()`` as ``op_runner._time`` times an op (the caller holds
torch at the timing threads; thread CPU time, median of samples, after warm-up steps that
allocate the state). ``cached_or_measured_optimizer`` caches the seconds beside the op
timings (``optim-<digest>.json``). ``cost.step.StepPart(optimizer_s=...)`` prices the
step's optimizer at that time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from autoprec.io.fileio import atomic_write
from autoprec.measure.op_runner import _time

VERSION = 1


def adamw_step(numels: Iterable[int]) -> Callable[[], Any]:
    """A default ``torch.optim.AdamW``'s ``step`` over fp32 tensors of ``numels`` (with
    gradients), its state allocated by one step already: the step ``measure_optimizer``
    times."""
    params = []
    for n in numels:
        p = torch.nn.Parameter(torch.empty(int(n)).uniform_(-0.1, 0.1))
        p.grad = torch.empty(int(n)).uniform_(-1e-3, 1e-3)
        params.append(p)
    if not params:
        return lambda: None
    opt = torch.optim.AdamW(params, lr=1e-5)
    opt.step()  # the state (exp_avg, exp_avg_sq) is allocated on the first step
    return opt.step


def measure_optimizer(numels: Iterable[int]) -> float:
    """Seconds of one default ``torch.optim.AdamW`` step over fp32 tensors of ``numels``."""
    return _time(adamw_step(numels))


def cached_or_measured_optimizer(numels: list[int], cache_dir: Path, digest: str,
                                 measure_now: bool) -> float | None:
    """The AdamW step's seconds for the trace whose op times have ``digest``, from the
    cache; else, with ``measure_now``, measured and cached; else None."""
    path = Path(cache_dir) / f"optim-{digest}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == VERSION and data.get("numels") == numels:
                return float(data["adamw_s"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if not measure_now:
        return None
    t0 = time.perf_counter()
    got = measure_optimizer(numels)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"version": VERSION, "seconds": time.perf_counter() - t0,
                                   "numels": numels, "adamw_s": got}))
    return got


__all__ = ["adamw_step", "cached_or_measured_optimizer", "measure_optimizer"]
