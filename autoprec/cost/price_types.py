"""What pricing a plan writes: the kernels it launches (``Kernel``), where one plan's
forward time goes (``Breakdown``, by ``PARTS``) and T plans priced at once (``Priced``).

The cost model (``cost.model``) fills them; the search, the CLI's ``explain`` and the
calibration read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autoprec.cost.profiles import DeviceProfile
from autoprec.plan.schedule import Schedule

#: Breakdown categories of a forward's time ("gemm_format_scaling": the quantise passes of
#: every GEMM format, fp8 / mxfp8 / nvfp4).
PARTS = ("gemm", "cast", "gemm_format_scaling", "other")
_GEMM, _CAST, _FP8, _OTHER = range(4)


@dataclass(frozen=True)
class Kernel:
    """One launched kernel, independent of the device."""

    what: str  # gemm, attention, cast, weight_cast, amax, fp8_scale, fp8_cast, pointwise, ...
    bytes: float
    flops: float = 0.0
    precision: str = "fp32"  # whose peak prices the FLOPs (and the GEMM set-up)
    launches: float = 1.0
    gemm_calls: float = 0.0

    def time(self, profile: DeviceProfile) -> float:
        """Seconds on ``profile`` (inf if the FLOPs need a precision it lacks)."""
        compute = 0.0
        if self.flops > 0:
            peak = profile.peak(self.precision)
            if peak <= 0:
                return math.inf
            compute = self.flops / peak
        return (max(compute, self.bytes / profile.bandwidth)
                + self.launches * profile.launch_overhead_s
                + self.gemm_calls * profile.setup(self.precision))

    def bound(self, profile: DeviceProfile) -> str:
        """What dominates: "compute", "memory" or "launch"."""
        peak = profile.peak(self.precision)
        parts = {"compute": self.flops / peak if peak > 0 else math.inf,
                 "memory": self.bytes / profile.bandwidth,
                 "launch": self.launches * profile.launch_overhead_s
                 + self.gemm_calls * profile.setup(self.precision)}
        return max(parts, key=lambda k: parts[k])


@dataclass
class Breakdown:
    """Where one plan's forward time goes (seconds), and how many casts it runs."""

    total_s: float
    parts: dict[str, float]  # PARTS -> seconds
    casts: int  # activation casts per forward (inserted + the model's own, where real)
    weight_casts: int  # autocast's per-call weight casts
    kernels: int  # kernel launches
    by_module: dict[str, float] = field(default_factory=dict)  # module path -> seconds
    gemm_precision: dict[str, str] = field(default_factory=dict)  # module -> its GEMMs' precision
    invalid: str | None = None  # why the plan cannot run

    def to_dict(self) -> dict[str, object]:
        return {"total_us": round(self.total_s * 1e6, 3),
                **{f"{k}_us": round(v * 1e6, 3) for k, v in self.parts.items()},
                "casts": self.casts, "weight_casts": self.weight_casts,
                "kernels": self.kernels}


@dataclass
class Priced:
    """T plans priced at once (rows)."""

    time: np.ndarray  # (T,) seconds; inf when infeasible or invalid
    parts: np.ndarray  # (T, 4) seconds per PARTS
    schedule: Schedule
    reasons: dict[int, str]  # row -> why infeasible / invalid


__all__ = ["Breakdown", "Kernel", "PARTS", "Priced"]
