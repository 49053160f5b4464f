"""What timing a model's ops on this machine gives (``OpTimes``) and how it is stored.

``measure.op_times`` measures it (``measure.ops``) or reads it from its cache; the cost model
(``cost.op_pricing``) prices with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Bump when what is measured or how changes: older cache files are then ignored.
VERSION = 10


def cast_key(numel: int, src: str, dst: str, weight: bool = False) -> str:
    return f"{numel}:{src}>{dst}{':w' if weight else ''}"


@dataclass
class OpTimes:
    """Seconds of each recorded op on this machine at ``batch_size`` (see module docs).

    ``compute[i][p]``: GEMM/SDPA op ``i`` computing in precision ``p``; ``compute_cl[i][p]``:
    the same for a convolution with its input and weight channels-last;
    ``compute_unfolded[i][p]``: the ``bmm`` inductor runs for GEMM ``i`` when its weight is
    cast (``cost.unfolded``); ``other[i][d]``:
    any other op (views included) with its floating inputs in dtype ``d`` ("-": it has
    none); ``casts[cast_key(...)]``: one cast; ``module_call_s``: one module call.
    """

    batch_size: int
    compute: dict[int, dict[str, float]] = field(default_factory=dict)
    other: dict[int, dict[str, float]] = field(default_factory=dict)
    casts: dict[str, float] = field(default_factory=dict)
    module_call_s: float = 0.0
    seconds: float = 0.0  # what measuring took
    distinct: int = 0  # distinct (op, dtype) timings
    machine: str = ""
    digest: str = ""
    cached: bool = False  # read from the cache (not measured by this process)
    wrapper_s: dict[str, float] = field(default_factory=dict)  # per form, one wrapped call
    compute_cl: dict[int, dict[str, float]] = field(default_factory=dict)
    compute_unfolded: dict[int, dict[str, float]] = field(default_factory=dict)

    def cast_s(self, numel: int, src: str, dst: str, weight: bool = False) -> float | None:
        got = self.casts.get(cast_key(numel, src, dst, weight))
        if got is None and weight:
            got = self.casts.get(cast_key(numel, src, dst))
        return got

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "batch_size": self.batch_size,
                "compute": {str(k): v for k, v in self.compute.items()},
                "other": {str(k): v for k, v in self.other.items()},
                "casts": self.casts, "module_call_s": self.module_call_s,
                "wrapper_s": self.wrapper_s,
                "compute_cl": {str(k): v for k, v in self.compute_cl.items()},
                "compute_unfolded": {str(k): v for k, v in self.compute_unfolded.items()},
                "seconds": self.seconds, "distinct": self.distinct,
                "machine": self.machine, "digest": self.digest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpTimes:
        return cls(int(data["batch_size"]),
                   {int(k): v for k, v in data["compute"].items()},
                   {int(k): v for k, v in data["other"].items()},
                   dict(data["casts"]), float(data["module_call_s"]),
                   float(data.get("seconds", 0.0)), int(data.get("distinct", 0)),
                   str(data.get("machine", "")), str(data.get("digest", "")),
                   wrapper_s={str(k): float(v) for k, v in data.get("wrapper_s", {}).items()},
                   compute_cl={int(k): v for k, v in data.get("compute_cl", {}).items()},
                   compute_unfolded={int(k): v for k, v in
                                     data.get("compute_unfolded", {}).items()})

    def describe(self) -> str:
        return (f"{len(self.compute) + len(self.other)} ops ({self.distinct} distinct "
                f"timings) and {len(self.casts)} casts timed here in {self.seconds:.1f}s"
                + (" (cached)" if self.cached else ""))


__all__ = ["VERSION", "OpTimes", "cast_key"]
