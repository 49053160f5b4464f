"""Memory a tune holds: the budget it keeps, the up-front refusal, the peak it reports.

The budget: besides the model itself, at most one more copy of its weights at a time.
Where each stage stands (measured by experiments/tune_size.py):

- references are kept as outputs (``evaluate.Reference``), never as a second model;
- the probes lower one layer at a time (``probe.shadow``: a layer's shadow computation
  casts or quantises that layer's weight for the call and drops it);
- a candidate plan is applied, scored and removed before the next (``apply_policy`` as a
  context manager): the deploy form's stored copies (16-bit casts, quantised weights and
  their scales) live only while that plan is scored, beside the model's own weights;
- the trace runs one forward of the model as it is.

``check_fits`` refuses, before any of that, a model the device cannot hold twice (the
model plus that one copy), in one line (``InputError``, exit 2). The limit is what the
device offers: on CPU the memory available to this process (``/proc/meminfo``'s
MemAvailable, or psutil's) plus what the model already takes; on CUDA the card's total
memory. ``limit_bytes`` overrides it (``tune --memory-limit``; tests inject a small one).

``peak_bytes`` is what tune reports as ``peak memory``: the process's peak resident set
(``getrusage(RUSAGE_SELF).ru_maxrss``) on CPU, ``torch.cuda.max_memory_allocated`` for a
model on CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from autoprec.errors import InputError

#: Where Linux says how much memory a new allocation can get without swapping.
MEMINFO = Path("/proc/meminfo")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers (a tied tensor once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _device(model: torch.nn.Module) -> torch.device:
    return next((t.device for t in model.parameters()), torch.device("cpu"))


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """Host memory available now (MemAvailable; psutil where /proc is absent), or None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except Exception:  # not installed, or no answer on this platform
        return None


def device_limit(model: torch.nn.Module) -> tuple[int | None, str]:
    """(bytes the device offers a tune of ``model``, where that figure comes from)."""
    dev = _device(model)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory), f"{dev} total memory"
    avail = available_bytes()
    if avail is None:
        return None, "unknown"
    # the model is already resident on the host: what it takes counts as offered
    return avail + weight_bytes(model), "available host memory (/proc/meminfo) + the model"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_fits(model: torch.nn.Module, where: str, limit_bytes: int | None = None) -> int:
    """Refuse (InputError, one line) a model the device cannot hold twice; returns the
    model's weight bytes. ``limit_bytes``: the device's memory (default: ``device_limit``)."""
    w = weight_bytes(model)
    if limit_bytes is not None:
        limit, source = int(limit_bytes), "--memory-limit"
    else:
        got, source = device_limit(model)
        if got is None:
            return w
        limit = got
    if 2 * w > limit:
        raise InputError(
            f"{where}: the model's weights take {gb(w)} and a tune holds them twice (the "
            f"model and one working copy: {gb(2 * w)}), more than the {gb(limit)} the "
            f"device offers ({source}); free memory, use a larger device, or tune a "
            "smaller model")
    return w


def reset_peak(model: torch.nn.Module | None = None) -> None:
    """Start counting the CUDA peak afresh (the CPU's resident peak cannot be reset)."""
    if model is not None and _device(model).type == "cuda":
        torch.cuda.reset_peak_memory_stats(_device(model))


def peak_bytes(model: torch.nn.Module | None = None) -> tuple[int, str]:
    """(peak bytes, what was measured): CUDA's peak allocation for a model on CUDA, else
    the process's peak resident set size."""
    if model is not None and _device(model).type == "cuda":
        dev = _device(model)
        return int(torch.cuda.max_memory_allocated(dev)), f"peak allocated on {dev}"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes
    return (int(rss) if sys.platform == "darwin" else int(rss) * 1024), "peak resident (RSS)"


__all__ = ["available_bytes", "check_fits", "device_limit", "gb", "peak_bytes", "reset_peak",
           "weight_bytes"]
