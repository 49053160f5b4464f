"""SensitivityTable: what the probes found, one row per (layer, precision).

Rows are dataclasses (the search reads them in its loops); pandas is the boundary for
people and files (``to_frame``, ``to_csv``). Units: ``local_error``, ``cheap_estimate``,
``e2e_output_error`` are relative L2 errors (docs/overview.md "Default error"); ``e2e_error`` is
the budget's unit — the output error, or the metric drop when the probe had a metric.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.formats.precisions import PRECISIONS

if TYPE_CHECKING:  # pandas is imported lazily: it is for the boundary
    import pandas as pd

#: Bump when rows change meaning: cached tables of another schema are recomputed.
SCHEMA = 1

#: Columns every table has, first, in this order (docs/overview.md "autoprec probe").
CORE_COLUMNS = ("layer", "precision", "local_error", "e2e_error", "max_abs", "overflow",
                "underflow_frac", "nonfinite", "reason")


@dataclass
class ProbeRow:
    """One layer in one precision. NaN means "not measured"."""

    layer: str
    precision: str
    kind: str = ""
    allowed: bool = True  # False: the layer cannot take this precision (``reason`` says why)
    hard: bool = False  # never assign: not allowed, overflow, non-finite, heavy underflow
    local_error: float = math.nan
    e2e_error: float = math.nan  # measured with only this layer lowered; budget units
    e2e_output_error: float = math.nan  # the same run's relative L2 output error
    cheap_estimate: float = math.nan  # first-order estimate of e2e_output_error
    estimate_method: str = ""  # "jacobian" (grads.py) or "local" (no gradient available)
    max_abs: float = math.nan  # max |y| in fp32 (outputs)
    in_max_abs: float = math.nan
    w_max_abs: float = math.nan
    overflow: int = 0  # values beyond the format's max: inputs + weights + outputs
    in_overflow: int = 0
    w_overflow: int = 0
    out_overflow: int = 0
    underflow_frac: float = 0.0  # worst of in/w/out: share of nonzero values below min normal
    in_underflow_frac: float = 0.0
    w_underflow_frac: float = 0.0
    out_underflow_frac: float = 0.0
    nonfinite: int = 0  # NaN/inf in the lowered output (fp32 finite)
    loss_effect: float = math.nan  # |∂L/∂y · (y_p − y_fp32)| per batch (first order)
    grad_error: float = math.nan  # the layer's backward in p vs fp32, relative L2
    grad_error_scaled: float = math.nan  # ... with the loss scale (fp16)
    grad_underflow: float = math.nan  # share of nonzero ∂L/∂y flushed to 0 in p's gradients
    grad_underflow_scaled: float = math.nan
    grad_overflow_scaled: int = 0
    calls: int = 0
    reason: str = ""

    @property
    def effect(self) -> float:
        """Measured output error when there is one, else the cheap estimate."""
        if not math.isnan(self.e2e_output_error):
            return self.e2e_output_error
        return self.cheap_estimate


@dataclass
class SensitivityTable:
    """Probe results for one model and data set. ``meta`` holds the budget, units, cost
    (forward-pass equivalents), seconds, versions and cache key."""

    rows: list[ProbeRow]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {(r.layer, r.precision): r for r in self.rows}

    def __iter__(self) -> Iterator[ProbeRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def layers(self) -> list[str]:
        """Probed layer paths in execution order."""
        return list(dict.fromkeys(r.layer for r in self.rows))

    @property
    def precisions(self) -> list[str]:
        seen = {r.precision for r in self.rows}
        return [p for p in PRECISIONS if p in seen]

    def row(self, layer: str, precision: str) -> ProbeRow:
        try:
            return self._index[(layer, precision)]
        except KeyError:
            raise KeyError(f"no probe row for layer {layer!r} in {precision!r}") from None

    def hard_excluded(self) -> dict[tuple[str, str], str]:
        """(layer, precision) pairs the search must never assign, with the reason:
        not allowed, overflow, non-finite output (also end to end), heavy underflow."""
        return {(r.layer, r.precision): r.reason for r in self.rows if r.hard}

    def estimate(self, layer: str, precision: str, measured: bool = True) -> float:
        """End-to-end output error (relative L2) of lowering ``layer`` alone.

        The measured value when an end-to-end run exists and ``measured``, else the cheap
        estimate; 0 for fp32 and for a layer's own precision (a bf16 model's layer in bf16:
        the model as given, not probed); inf for a hard-excluded pair.
        """
        if precision == "fp32" or self.meta.get("own", {}).get(layer) == precision:
            return 0.0  # the reference itself (a 16-bit layer in its own dtype: as given)
        r = self.row(layer, precision)
        if r.hard:
            return math.inf
        value = r.effect if measured else r.cheap_estimate
        return r.local_error if math.isnan(value) else value

    def combined_estimate(self, assignment: Mapping[str, str]) -> float:
        """Estimated output error of a whole assignment {layer: precision}: independent
        rounding errors add in squares, so sqrt(Σ estimate²)."""
        return math.sqrt(sum(self.estimate(lay, p) ** 2 for lay, p in assignment.items()
                             if p != "fp32"))

    # -- the boundary ----------------------------------------------------------------------

    def to_frame(self) -> pd.DataFrame:
        """Every row; the docs/overview.md CSV columns first, then the rest."""
        import pandas as pd

        names = [f.name for f in dataclasses.fields(ProbeRow)]
        cols = list(CORE_COLUMNS) + [n for n in names if n not in CORE_COLUMNS]
        return pd.DataFrame([dataclasses.asdict(r) for r in self.rows], columns=cols)

    def ranked(self) -> pd.DataFrame:
        """Rows worst first: hard exclusions, then by estimated end-to-end effect."""
        df = self.to_frame()
        df["_effect"] = [math.inf if r.hard else r.effect for r in self.rows]
        df = df.sort_values("_effect", ascending=False, kind="stable", na_position="last")
        return df.drop(columns="_effect").reset_index(drop=True)

    def to_csv(self, path: str | Path) -> None:
        self.to_frame().to_csv(path, index=False)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "meta": _jnum(self.meta),
                "rows": [{k: _jnum(v) for k, v in dataclasses.asdict(r).items()}
                         for r in self.rows]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SensitivityTable:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"probe table schema {data.get('schema')!r}, expected {SCHEMA}")
        known = {f.name for f in dataclasses.fields(ProbeRow)}
        rows = [ProbeRow(**{k: _unjnum(v) for k, v in r.items() if k in known})
                for r in data["rows"]]
        return cls(rows, dict(data.get("meta", {})))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False)


def _jnum(v: Any) -> Any:
    """JSON has no NaN/inf: store them as strings (recursively in containers)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, Mapping):
        return {str(k): _jnum(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jnum(x) for x in v]
    return v


def _unjnum(v: Any) -> Any:
    return float(v) if v in ("nan", "inf", "-inf") else v
