"""Fit a profile's efficiency factors and launch overhead to measured times.

The estimate of a run is a sum over kernels of ``max(FLOPs / (peak x eff_p), bytes /
(bw x mem_eff)) + launches x overhead (+ GEMM calls x setup_p)``. Once it is known which
term of each max binds, the time is *linear* in the unknowns ``1/eff_p``, ``1/mem_eff``,
``overhead`` and ``setup_p``. ``fit`` alternates: decide the binding term of every kernel
with the current factors, solve the bounded linear least-squares problem (rows weighted
by 1/measured, i.e. relative error; ``scipy.optimize.lsq_linear``), repeat until the
binding pattern no longer changes.

Samples are (CostModel, assignment, measured seconds); the single-op graphs below make
micro-benchmark samples (one GEMM, one copy) that pin each factor down separately.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoprec.cost.model import CostModel, Kernel
from autoprec.cost.profiles import Calibration, DeviceProfile
from autoprec.errors import InputError
from autoprec.formats.gemm import gemm_format
from autoprec.formats.precisions import GEMM_FORMATS, REGIONS
from autoprec.policy.schema import Policy
from autoprec.trace.graph import LayerGraph, LayerNode
from autoprec.trace.ops import Call, Op, OpTrace, Value

# Bounds keep an ill-determined factor sane: efficiency in [1%, 300%] of the profile's
# peak (>100% happens on CPUs, whose "peaks" are themselves measured: bf16 AMX fits ~1.8x
# here), launch <= 1 ms.
_INV_EFF_BOUNDS = (1 / 3.0, 100.0)
_LAUNCH_BOUNDS = (0.0, 1e-3)
_SETUP_BOUNDS = (0.0, 1e-2)


@dataclass(frozen=True)
class Sample:
    """One measurement: ``model`` run under ``assignment`` took ``seconds``."""

    model: CostModel
    assignment: Policy | Mapping[str, str]
    seconds: float
    label: str = ""


@dataclass
class FitResult:
    calibration: Calibration
    profile: DeviceProfile  # the input profile with the fitted factors
    predicted: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    iterations: int = 0

    @property
    def rel_errors(self) -> list[float]:
        return [(p - m) / m for p, m in zip(self.predicted, self.measured, strict=True)]


def _columns(kernels: Sequence[Kernel], fit_setup: bool) -> list[str]:
    cols: list[str] = ["mem", "launch"]
    for k in kernels:
        if k.flops > 0 and f"eff:{k.precision}" not in cols:
            cols.append(f"eff:{k.precision}")
        if fit_setup and k.gemm_calls > 0 and f"setup:{k.precision}" not in cols:
            cols.append(f"setup:{k.precision}")
    return cols


def _features(kernels: Sequence[Kernel], raw: DeviceProfile, cur: DeviceProfile,
              col: Mapping[str, int], fit_setup: bool
              ) -> tuple[np.ndarray, float, tuple[bool, ...]]:
    """Feature row (coefficients of the unknowns), the part not fitted (a constant) and
    which kernels are compute-bound."""
    x = np.zeros(len(col))
    const = 0.0
    bound: list[bool] = []
    for k in kernels:
        mem = k.bytes / raw.memory_bw
        comp = 0.0
        if k.flops > 0:
            peak = raw.peak_flops.get(k.precision) or 0.0
            if peak <= 0:
                raise InputError(f"calibration sample runs {k.precision}, which "
                                 f"{raw.name} does not support")
            comp = k.flops / peak
        # binding decided with the current factors
        is_compute = comp > 0 and (comp / cur.efficiency.get(k.precision, 1.0)
                                   >= mem / cur.memory_efficiency)
        bound.append(is_compute)
        if is_compute:
            x[col[f"eff:{k.precision}"]] += comp
        else:
            x[col["mem"]] += mem
        x[col["launch"]] += k.launches
        if k.gemm_calls > 0:
            if fit_setup:
                x[col[f"setup:{k.precision}"]] += k.gemm_calls
            else:
                const += k.gemm_calls * cur.setup(k.precision)
    return x, const, tuple(bound)


def fit(
    profile: DeviceProfile,
    samples: Sequence[Sample],
    *,
    fit_launch: bool = True,
    fit_setup: bool = False,
    note: str = "",
    max_iter: int = 25,
) -> FitResult:
    """Least-squares factors for ``profile`` from ``samples`` (see the module docstring).

    ``profile`` should be the uncalibrated one (its ``efficiency`` is the starting point).
    Factors whose columns no sample exercises keep the profile's values.
    """
    if not samples:
        raise InputError("calibration needs at least one measured sample")
    for s in samples:
        if not (s.seconds > 0 and math.isfinite(s.seconds)):
            raise InputError(f"sample {s.label!r}: measured seconds > 0 must hold, "
                             f"but got {s.seconds!r}")
    kernel_lists = [s.model.kernels(s.assignment) for s in samples]
    cols = _columns([k for ks in kernel_lists for _, k in ks], fit_setup)
    col = {c: i for i, c in enumerate(cols)}
    y = np.array([s.seconds for s in samples])
    w = 1.0 / y  # relative error
    lo = np.array([_LAUNCH_BOUNDS[0] if c == "launch" else _SETUP_BOUNDS[0]
                   if c.startswith("setup:") else _INV_EFF_BOUNDS[0] for c in cols])
    hi = np.array([_LAUNCH_BOUNDS[1] if c == "launch" else _SETUP_BOUNDS[1]
                   if c.startswith("setup:") else _INV_EFF_BOUNDS[1] for c in cols])
    if not fit_launch:
        i = col["launch"]
        lo[i] = hi[i] = profile.launch_overhead_s
        hi[i] += 1e-15  # lsq_linear wants lo < hi

    from scipy.optimize import lsq_linear  # scipy is a dependency; imported where used

    cur = profile
    pattern: tuple[tuple[bool, ...], ...] | None = None
    iterations = 0
    for _ in range(max_iter):
        iterations += 1
        rows, consts, bits = zip(*[_features([k for _, k in ks], profile, cur, col,
                                             fit_setup) for ks in kernel_lists], strict=True)
        X = np.vstack(rows)
        c = np.array(consts)
        used = X.any(axis=0)
        sol = lsq_linear(X[:, used] * w[:, None], (y - c) * w,
                         bounds=(lo[used], hi[used]))
        theta = np.full(len(cols), np.nan)
        theta[used] = sol.x
        cur = _apply(profile, cols, theta)
        if bits == pattern:
            break
        pattern = bits
    predicted = [float(s.model.with_profile(cur).estimate(s.assignment)) for s in samples]
    rel = np.array([(p - m) / m for p, m in zip(predicted, y, strict=True)])
    cal = Calibration(
        device=profile.name,
        efficiency={p: v for p, v in cur.efficiency.items()
                    if f"eff:{p}" in col and used[col[f"eff:{p}"]]},
        memory_efficiency=cur.memory_efficiency if used[col["mem"]] else None,
        launch_overhead_s=cur.launch_overhead_s if (fit_launch and used[col["launch"]])
        else None,
        gemm_setup_s={p: v for p, v in cur.gemm_setup_s.items()
                      if f"setup:{p}" in col and used[col[f"setup:{p}"]]},
        n_samples=len(samples),
        rel_rmse=float(np.sqrt(np.mean(rel**2))),
        note=note,
    )
    return FitResult(cal, cur, predicted, [float(v) for v in y],
                     [s.label for s in samples], iterations)


def _apply(profile: DeviceProfile, cols: Sequence[str], theta: np.ndarray) -> DeviceProfile:
    eff: dict[str, float] = {}
    setup: dict[str, float] = {}
    mem = launch = None
    for name, v in zip(cols, theta, strict=True):
        if np.isnan(v):
            continue
        if name == "mem":
            mem = 1.0 / v
        elif name == "launch":
            launch = float(v)
        elif name.startswith("eff:"):
            eff[name[4:]] = 1.0 / v
        else:
            setup[name[6:]] = float(v)
    return profile.with_factors(eff, mem, launch, setup)


# --- single-op graphs for micro-benchmarks (also handy for hand-computed tests) -------

def _graph(path: str, module_type: str, kind: str, values: list[Value], op: Op, calls: int,
           batch_size: int, allowed: list[str], name: str) -> LayerGraph:
    """A model of one leaf module ``path`` under a container root, running ``op`` ``calls``
    times per forward: its layer graph and op trace, as ``trace()`` would record them."""
    ops = OpTrace(modules=["", path], values=values, batch_size=batch_size)
    ops.calls.append(Call(0, (0,), op.outputs))
    ops.events.append((1, 0))
    for i in range(calls):
        ops.calls.append(Call(1, op.inputs[:1], op.outputs))
        ops.events.append((1, len(ops.calls) - 1))
        ops.ops.append(op)
        ops.events += [(0, i), (2, len(ops.calls) - 1)]
    ops.events.append((2, 0))
    root = LayerNode(path="", module_type="Sequential", kind="container", is_leaf=False,
                     depth=0, calls=1, allowed=allowed)
    leaf = LayerNode(path=path, module_type=module_type, kind=kind, is_leaf=True, depth=1,
                     calls=calls, flops=int(op.flops) * calls, allowed=allowed)
    return LayerGraph(nodes={"": root, path: leaf}, tracer="manual", batch_size=batch_size,
                      model_name=name, ops=ops)


def gemm_graph(m: int, k: int, n: int, calls: int = 1, batch_size: int = 1,
               path: str = "gemm") -> LayerGraph:
    """A graph holding one Linear (no bias): (m, k) @ (k, n), ``calls`` times per pass."""
    vals = [Value(m * k, "fp32", 4, "input", True, 2), Value(k * n, "fp32", 4, "param", False, 2),
            Value(m * n, "fp32", 4, "op", True, 2)]
    op = Op("linear", "gemm", 1, (0, 1), (2,), 2.0 * m * k * n, weight=1)
    # the GEMM formats whose alignment rules a (k, n) Linear meets, as the tracer decides
    allowed = [*REGIONS, *(f for f in GEMM_FORMATS if not gemm_format(f).shape_problems(k, n))]
    return _graph(path, "Linear", "linear", vals, op, calls, batch_size, allowed,
                  f"gemm {m}x{k}x{n}")


def copy_graph(elems: int, calls: int = 1, path: str = "copy") -> LayerGraph:
    """A graph holding one memory-bound elementwise op reading and writing ``elems``."""
    vals = [Value(elems, "fp32", 4, "input", True, 1), Value(elems, "fp32", 4, "op", True, 1)]
    op = Op("clone", "pointwise", 1, (0,), (1,))
    return _graph(path, "Identity", "elementwise", vals, op, calls, 1, ["fp32"],
                  f"copy {elems}")


__all__ = ["FitResult", "Sample", "copy_graph", "fit", "gemm_graph"]
