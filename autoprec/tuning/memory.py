"""Memory a tune holds: the budget it keeps, the up-front refusal, the peak it reports.

The budget: besides the model itself, at most one more copy of its weights at a time.
Where each stage stands (measured by benchmarks/tune_size.py):

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

Between stages ``release_freed`` hands the C heap's free pages back to the OS (glibc's
``malloc_trim``), and the CLI calls ``map_large_allocations`` once so that large tensors
are mmapped and unmapped when freed (a fragmented heap otherwise keeps a freed probe's
copies resident: 2.34 GB -> 2.07 GB peak on the 160 M GPT-2). ``StagePeaks`` measures the
peak of each stage on its own (Linux: ``/proc/self/clear_refs`` resets VmHWM).

``peak_bytes`` is what tune reports as ``peak memory``: the process's peak resident set
(``getrusage(RUSAGE_SELF).ru_maxrss``) on CPU, ``torch.cuda.max_memory_allocated`` for a
model on CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import InputError

#: Where Linux says how much memory a new allocation can get without swapping.
MEMINFO = Path("/proc/meminfo")
#: Writing "5" resets the process's peak resident set (VmHWM) to its current one (Linux).
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
#: mallopt's parameter number for the mmap threshold (glibc malloc.h: M_MMAP_THRESHOLD -3)
M_MMAP_THRESHOLD = -3
#: 1 MiB: an allocation this large (a 512 x 512 fp32 tensor) is mmapped, not heap-allocated
MMAP_THRESHOLD = 1 << 20


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


def _proc_bytes(path: Path, key: str) -> int | None:
    """A ``key:  N kB`` line of a /proc file (meminfo, self/status) in bytes, or None."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """Host memory available now (MemAvailable; psutil where /proc is absent), or None."""
    got = _proc_bytes(meminfo, "MemAvailable")
    if got is not None:
        return got
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


#: Activations a streamed tune keeps, per token: the logits of the reference, of the plan
#: being scored and one working copy (fp32, ``vocab`` each) and ~16 hidden-size fp32 vectors
#: (a block's inputs, outputs and intermediates; the MLP's intermediate counted as 4).
LOGIT_COPIES, HIDDEN_COPIES = 3, 16


def streamed_bytes(resident: int, block: int, vocab: int, hidden: int, tokens: int,
                   unit: int = 0, widen: float = 1.0) -> tuple[int, int]:
    """(bytes a streamed tune needs, of which activations): the resident parts, the largest
    block with a plan's copy of it, a plan's copy of the largest resident module (``unit``:
    the embeddings or LM head), each copy up to ``widen`` times as large as held (the fp32
    row of a bf16 model: 2), and the activations of ``tokens`` tokens (``LOGIT_COPIES``
    logits, ``HIDDEN_COPIES`` hidden vectors, fp32)."""
    act = tokens * 4 * (LOGIT_COPIES * vocab + HIDDEN_COPIES * hidden)
    return int(resident + block + widen * (block + unit) + act), act


def streamed_need(stream: Any, tokens: int) -> tuple[int, int, int, str]:
    """(bytes a streamed tune needs, resident bytes, activations, the largest block's path)
    of a streamed model (``streamed_bytes`` on its checkpoint's headers and config)."""
    mem = stream.memory
    cfg = stream.model.config
    need, act = streamed_bytes(mem.resident_bytes, mem.largest_block_bytes,
                               int(getattr(cfg, "vocab_size", 0) or 0),
                               int(getattr(cfg, "hidden_size", 0) or 0), tokens,
                               mem.largest_resident_bytes, mem.widen)
    return need, mem.resident_bytes, act, mem.largest_block


def _check_streamed(stream: Any, where: str, limit_bytes: int | None, tokens: int) -> int:
    need, resident, act, block = streamed_need(stream, tokens)
    size = stream.memory.largest_block_bytes
    if limit_bytes is not None:
        limit, source = int(limit_bytes), "--memory-limit"
    elif stream.ckpt.device.type == "cuda":
        dev = stream.ckpt.device
        limit, source = int(torch.cuda.get_device_properties(dev).total_memory), \
            f"{dev} total memory"
    else:
        got = available_bytes()
        if got is None:
            return need
        limit, source = got + resident, "available host memory (/proc/meminfo) + the resident parts"
    if need > limit:
        raise InputError(
            f"{where}: the largest block ({block}, {gb(size)}, with a plan's copy) plus "
            f"activations ({gb(act)}) and the resident embeddings and head ({gb(resident)}, "
            f"with a plan's copy of {stream.memory.largest_resident}) do not fit in "
            f"{gb(limit)} ({source}; {gb(need)} needed)")
    return need


def check_fits(model: torch.nn.Module, where: str, limit_bytes: int | None = None, *,
               tokens: int = 256) -> int:
    """Refuse (InputError, one line) a model the device cannot hold twice; returns the
    model's weight bytes. ``limit_bytes``: the device's memory (default: ``device_limit``).
    A model streamed from its checkpoint (``autoprec.stream``) needs its resident parts,
    its largest block twice and the activations of ``tokens`` tokens (``streamed_need``)
    instead; the refusal names the block."""
    stream = getattr(model, "autoprec_stream", None)
    if stream is not None:
        return _check_streamed(stream, where, limit_bytes, tokens)
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


def _libc() -> ctypes.CDLL | None:
    """glibc, or None (musl, macOS, Windows: the calls below are no-ops there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def release_freed() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``), after a
    ``gc.collect()`` so cycles holding tensors go first. False where not glibc."""
    import gc

    gc.collect()
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes or more by mmap (glibc ``mallopt``), so a
    freed tensor goes back to the OS at once. Process-wide: the CLI calls it at start.
    False where not glibc."""
    lib = _libc()
    if lib is None:
        return False
    return bool(lib.mallopt(M_MMAP_THRESHOLD, int(threshold)))


def _vm_hwm(status: Path = STATUS) -> int | None:
    return _proc_bytes(status, "VmHWM")


def _reset_hwm(clear_refs: Path = CLEAR_REFS) -> bool:
    try:
        clear_refs.write_text("5")
    except OSError:
        return False
    return True


class StagePeaks:
    """The peak memory of each stage of a tune, measured on its own.

    ``with peaks.stage("probe"): ...`` frees what earlier stages left (``release_freed``),
    resets the peak counter (CUDA's peak for a model on CUDA; on Linux the resident peak,
    VmHWM, via ``/proc/self/clear_refs``) and records the stage's peak on exit. Where the
    resident peak cannot be reset the figure is the process's peak so far (``ru_maxrss``),
    and ``resettable`` is False.
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall time of each stage
        #: CPU time of each stage (this process, every thread: ``time.process_time``)
        self.cpu_seconds: dict[str, float] = {}
        self.resettable = True

    def _cuda(self) -> bool:
        return self.model is not None and _device(self.model).type == "cuda"

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.peaks:  # what came before the first stage (the model's load): its peak
            self.peaks["load"] = self._peak()
        release_freed()
        if self._cuda():
            reset_peak(self.model)
        elif not _reset_hwm():
            self.resettable = False
        started, cpu = time.monotonic(), time.process_time()
        try:
            yield
        finally:
            self.peaks[name] = max(self.peaks.get(name, 0), self._peak())
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started
            self.cpu_seconds[name] = (self.cpu_seconds.get(name, 0.0)
                                      + time.process_time() - cpu)

    def _peak(self) -> int:
        if self._cuda():
            return peak_bytes(self.model)[0]
        hwm = _vm_hwm() if self.resettable else None
        return hwm if hwm is not None else peak_bytes()[0]

    @property
    def overall(self) -> int:
        """The peak over every stage. On Linux the reset also resets ``ru_maxrss``, so
        after a stage this, not ``peak_bytes``, is the process's peak."""
        return max(self.peaks.values(), default=0)

    @property
    def highest(self) -> str | None:
        """The stage with the highest peak (None before any)."""
        return max(self.peaks, key=self.peaks.__getitem__) if self.peaks else None

    def summary(self) -> str:
        """``trace 1.20 GB, probe 2.07 GB, ...`` in stage order."""
        return ", ".join(f"{k} {gb(v)}" for k, v in self.peaks.items())


__all__ = ["StagePeaks", "available_bytes", "check_fits", "device_limit", "gb", "map_large_allocations",
           "peak_bytes", "release_freed", "reset_peak", "weight_bytes"]
