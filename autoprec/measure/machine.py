"""Is a target profile the machine this runs on? And which machine is that?

A *local* target is one whose device is at hand: the ``cpu`` profile (this
machine's CPU), or a GPU profile whose name matches a CUDA device here (``h200`` and
"NVIDIA H200"). Its speed can be measured instead of taken from a profile fitted
elsewhere: the team's CPUs differ (one with AMX-BF16 ran bf16 matmuls ~3x faster than
fp32, one with AVX512-BF16 alone slower; docs/overview.md), so the shipped ``cpu`` figures are
one machine's, not this one's.

``Machine`` holds the facts that decide 16-bit speed here — the CPU's matmul features
(``capability.CPU_FLAGS``) or the GPU's name and compute capability, the torch version and
the threads timings use — and names the calibration cached for it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.cost.profiles import Calibration, DeviceProfile, load_calibration
from autoprec.device.capability import CPU_FLAGS, cpu_flags
from autoprec.device.targets import cuda_index, device_kind, is_cpu, is_cpu_target
from autoprec.errors import InputError

#: CPU timings run on one torch thread and read the thread's CPU time: on a shared,
#: oversubscribed machine the wall time of one forward varied 10x (benchmarks/
#: cost_model_cpu.py); the ratios between precisions are what a plan is chosen on.
CPU_THREADS = 1


@dataclass(frozen=True)
class Machine:
    """The device a local target runs on, and what decides its speed."""

    device: str  # "cpu" or "cuda:N": where timings run
    name: str  # CPU model name, or the GPU's name
    features: tuple[str, ...]  # CPU: its 16-bit matmul flags; GPU: ("sm_90",)
    torch: str
    threads: int  # torch threads of the timings (CPU); 0 on a GPU

    @property
    def key(self) -> str:
        """Short hash of the facts: the calibration cache's file name."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def describe(self) -> str:
        feats = ", ".join(self.features) or "no 16-bit matmul features"
        how = f", {self.threads} thread" if self.threads else ""
        return f"{self.name} ({feats}; torch {self.torch}{how})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["features"] = list(self.features)
        return d


def this_machine(device: str = "cpu") -> Machine:
    """The facts of ``device`` here ("cpu" or "cuda[:N]")."""
    if is_cpu(device_kind(device)):  # device_kind: an unknown device is an InputError
        name, flags = cpu_flags()
        return Machine("cpu", name, tuple(f for f in CPU_FLAGS if f in flags),
                       str(torch.__version__), CPU_THREADS)
    index = cuda_index(device)
    major, minor = torch.cuda.get_device_capability(index)
    return Machine(f"cuda:{index}", torch.cuda.get_device_name(index),
                   (f"sm_{major}{minor}",), str(torch.__version__), 0)


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", text.lower()) if t]


def local_device(profile: DeviceProfile) -> tuple[str | None, str]:
    """``(device, why)``: the device here that ``profile`` describes — ``"cpu"`` for a CPU
    profile, ``"cuda:N"`` for a GPU profile whose name is a word of a CUDA device's name
    ("h200" in "NVIDIA H200") — or ``(None, why not)``."""
    if is_cpu_target(profile.name):
        return "cpu", f"the {profile.name} target is this machine's CPU"
    here = [f"CPU {cpu_flags()[0]}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            if profile.name in _tokens(name):
                return f"cuda:{i}", f"{name} (cuda:{i}) is a {profile.name}"
            here.append(f"cuda:{i} {name}")
    return None, (f"no {profile.name} here (this machine: {', '.join(here)}): speed "
                  f"estimated from the stored {profile.name} profile, not measured")


def calibration_path(cache_dir: str | Path, profile: DeviceProfile, machine: Machine,
                     mode: str = "eager") -> Path:
    """Where the calibration of ``profile`` measured on ``machine`` in deployment ``mode``
    (eager, or compiled micro-benchmarks) is cached."""
    tag = "" if mode == "eager" else f"-{mode}"
    return Path(cache_dir) / f"{profile.name}{tag}-{machine.key}.yaml"


def cached_calibration(cache_dir: str | Path, profile: DeviceProfile, machine: Machine,
                       mode: str = "eager") -> Calibration | None:
    """The cached calibration for this profile on this machine in ``mode``, if one is there
    and was measured on the same facts (a file of another machine or mode, or unreadable,
    is ignored)."""
    path = calibration_path(cache_dir, profile, machine, mode)
    if not path.is_file():
        return None
    try:
        cal = load_calibration(path)
    except InputError:
        return None  # a torn or foreign file: measure again (and overwrite it)
    if (cal.device != profile.name or dict(cal.machine) != machine.to_dict()
            or cal.mode != mode):
        return None
    return cal




@contextmanager
def timing_threads(device: str) -> Iterator[None]:
    """Torch threads for timings on ``device``: ``CPU_THREADS`` on a CPU (restored after)."""
    if not is_cpu(device):
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(old)


__all__ = ["CPU_THREADS", "Machine", "cached_calibration", "calibration_path",
           "local_device", "this_machine", "timing_threads"]
