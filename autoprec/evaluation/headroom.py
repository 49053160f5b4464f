"""Headroom: how far each low-precision layer's values stay from its format's limit.

For every GEMM layer in a 16-bit or GEMM-format precision (bf16, fp16, fp8, mxfp8, nvfp4),
the largest |value| of its inputs and output on the calibration data (the fp32 model, one
pass with forward hooks) against the max of the format they are carried in
(``precisions.carrier_of``: the layer's own, or its region's for a GEMM format, whose
per-call scaling keeps e4m3's 448 from binding). ``headroom = limit / max_abs``: 1 is at
the limit, 16 leaves four binades. fp16 (65504) is the format that runs out; bf16 layers
are listed too, with fp32's range. A deployment whose inputs grow past the headroom
overflows; ``apply.guard`` catches that at run time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.formats.precisions import FORMATS, GEMM_FORMATS, carrier_of
from autoprec.workload.metrics import iter_floats

#: Precisions whose layers get a headroom row (tf32 / fp32 keep fp32's range and storage).
LOW = ("bf16", "fp16", *GEMM_FORMATS)
#: Below this the tuner notes a layer's headroom in the policy's reasons.
NOTE_BELOW = 100.0


@dataclass(frozen=True)
class Headroom:
    """One layer: ``max_abs`` (inputs and output, fp32, calibration data) vs ``limit``."""

    layer: str
    precision: str
    carrier: str  # the format whose max binds
    max_abs: float
    limit: float

    @property
    def headroom(self) -> float:
        return self.limit / self.max_abs if self.max_abs > 0 else math.inf

    def note(self) -> str:
        """For the policy's reasons (no ``"<precision>:"`` token: a guard reads those as
        refusals)."""
        of = self.carrier if self.carrier == self.precision else \
            f"{self.carrier} (the {self.precision} layer's region)"
        return (f"headroom {self.headroom:.3g}x on calibration data: max |x|, |y| "
                f"{self.max_abs:.3g} of {of}'s {self.limit:g}")

    def to_dict(self) -> dict[str, Any]:
        h = self.headroom
        return {"layer": self.layer, "precision": self.precision, "format": self.carrier,
                "max_abs": self.max_abs, "limit": self.limit,
                "headroom": h if math.isfinite(h) else None}


def measure_headroom(model: torch.nn.Module, batches: Iterable[Any],
                     run: Callable[[torch.nn.Module, Any], Any],
                     layers: Mapping[str, tuple[str, str]]) -> list[Headroom]:
    """Headroom rows for ``layers`` (path -> (precision, region)) whose precision is in
    LOW, measured by ``run(model, batch)`` over ``batches`` on ``model`` as it is (fp32:
    call it with no policy applied). Rows in ``layers``' order."""
    wanted = {p: pr for p, pr in layers.items() if pr[0] in LOW}
    peak = dict.fromkeys(wanted, 0.0)
    modules = dict(model.named_modules())

    def hook(path: str) -> Any:
        def fn(mod: torch.nn.Module, args: Any, out: Any) -> None:
            for t in [*iter_floats(args), *iter_floats(out)]:
                if t.numel():
                    a = t.detach().abs()
                    m = float(torch.where(torch.isfinite(a), a, 0).amax())
                    peak[path] = max(peak[path], m)
        return fn

    handles = [modules[p].register_forward_hook(hook(p)) for p in wanted if p in modules]
    try:
        with torch.no_grad():
            for b in batches:
                run(model, b)
    finally:
        for h in handles:
            h.remove()
    out = []
    for p, (prec, region) in wanted.items():
        carrier = carrier_of(prec, region)
        out.append(Headroom(p, prec, carrier, peak[p], FORMATS[carrier].max))
    return out


def smallest(rows: Iterable[Headroom]) -> Headroom | None:
    """The row with the least headroom (None: no rows)."""
    return min(rows, key=lambda r: r.headroom, default=None)


__all__ = ["LOW", "NOTE_BELOW", "Headroom", "measure_headroom", "smallest"]
