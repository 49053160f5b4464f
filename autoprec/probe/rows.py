"""Turn the probes' accumulators into table rows, hard exclusions and reasons.

Hard (the search never assigns the pair): the layer may not take the precision; a value
of its inputs, weights or outputs overflows the format (T5's fp16 FFN, transformers#9295:
range is a hard constraint found from activations, not from mean error); its lowered
output, or the model's output with it lowered, is non-finite; or at least
``underflow_limit`` of its nonzero values fall below the format's smallest normal; with
gradient probes, its gradients flush or lose their signal (``grad_rules.py``).
Soft (the search weighs them): the estimated or measured end-to-end error against the
budget, and light underflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from autoprec.formats.gemm import format_of
from autoprec.formats.precisions import FORMATS, is_gemm_format
from autoprec.probe.grad_rules import DEFAULT_LOSS_SCALE, grad_verdict
from autoprec.probe.grads import GradStats
from autoprec.probe.layers import ProbeLayer
from autoprec.probe.ranges import TensorRange, fmt_num
from autoprec.probe.shadow import LocalStats
from autoprec.probe.table import ProbeRow

_SYMBOL = {"in": "x", "w": "w", "out": "y"}


def build_row(layer: ProbeLayer, precision: str, local: LocalStats | None,
              ranges: Mapping[str, TensorRange], estimate: float, method: str,
              grad: GradStats | None) -> ProbeRow:
    """One row from the accumulators (no reason yet: see ``judge``)."""
    r = ProbeRow(layer=layer.path, precision=precision, kind=layer.kind)
    rin, rw, rout = ranges["in"], ranges["w"], ranges["out"]
    r.max_abs, r.in_max_abs = rout.max_abs, rin.max_abs
    r.w_max_abs = rw.max_abs if rw.numel else math.nan
    r.in_overflow = rin.overflow.get(precision, 0)
    r.w_overflow = rw.overflow.get(precision, 0)
    r.out_overflow = rout.overflow.get(precision, 0)
    r.overflow = r.in_overflow + r.w_overflow + r.out_overflow
    r.in_underflow_frac = rin.underflow_frac(precision)
    r.w_underflow_frac = rw.underflow_frac(precision)
    # An fp8 GEMM reads e4m3 operands but writes 16-bit output (docs/overview.md): its output is
    # not held in e4m3, so output underflow is not counted against fp8.
    r.out_underflow_frac = 0.0 if is_gemm_format(precision) else rout.underflow_frac(precision)
    r.underflow_frac = max(r.in_underflow_frac, r.w_underflow_frac, r.out_underflow_frac)
    if precision in layer.disallowed:
        r.allowed, r.hard = False, True
        r.reason = layer.disallowed[precision]
        return r
    if local is not None:
        r.local_error, r.nonfinite, r.calls = local.error, local.nonfinite, local.calls
    r.cheap_estimate = math.inf if r.nonfinite else estimate
    r.estimate_method = method
    if grad is not None and grad.nonzero + grad.batches > 0:
        r.loss_effect = grad.loss_effect
        r.grad_error, r.grad_error_scaled = grad.grad_error, grad.grad_error_scaled
        r.grad_underflow = grad.underflow(scaled=False)
        r.grad_underflow_scaled = grad.underflow(scaled=True)
        r.grad_overflow_scaled = grad.overflow_scaled
    return r


def judge(r: ProbeRow, ranges: Mapping[str, TensorRange], budget: float, units: str,
          underflow_limit: float = 0.1, loss_scale: float = DEFAULT_LOSS_SCALE) -> None:
    """Set ``r.hard`` and ``r.reason`` (hard reasons first, then soft ones). With gradient
    probes (a loss), the training rule of ``grad_rules.py`` adds its own."""
    if not r.allowed:
        return
    p, fmt = r.precision, FORMATS[r.precision]
    hard: list[str] = []
    soft: list[str] = []
    for part, n in (("out", r.out_overflow), ("in", r.in_overflow), ("w", r.w_overflow)):
        if n:
            hard.append(f"{p}: overflow, max|{_SYMBOL[part]}| {fmt_num(ranges[part].max_abs)} "
                        f"> {fmt.max:g} ({n} values)")
    if r.nonfinite:
        hard.append(f"{p}: non-finite output ({r.nonfinite} values)")
    if r.e2e_output_error == math.inf or r.e2e_error == math.inf:
        hard.append(f"{p}: non-finite model output with only this layer lowered")
    for part, frac in (("out", r.out_underflow_frac), ("in", r.in_underflow_frac),
                       ("w", r.w_underflow_frac)):
        if frac < min(0.05, underflow_limit):  # a few subnormals are normal (GELU tails)
            continue
        gemm = format_of(p)
        floor = (f"its amax/{fmt.max:g} x 2**{math.log2(fmt.smallest_normal):g}"
                 if gemm is not None and gemm.per_tensor_scaled else f"{fmt.smallest_normal:.2g}")
        text = f"{p}: underflow, {frac:.0%} of nonzero |{_SYMBOL[part]}| below {floor}"
        (hard if frac >= underflow_limit else soft).append(text)
    grad = grad_verdict(r, loss_scale, flush_limit=underflow_limit)
    hard.extend(grad.hard)
    soft.extend(grad.soft)
    r.hard = bool(hard)
    if not r.hard:
        soft.extend(_over_budget(r, budget, units))
    r.reason = "; ".join(hard + soft)


def _over_budget(r: ProbeRow, budget: float, units: str) -> list[str]:
    p = r.precision
    local = fmt_num(r.local_error)
    if not math.isnan(r.e2e_error):
        if r.e2e_error <= budget:
            return []
        what = "metric drop" if units == "metric_drop" else "e2e error"
        text = f"{p}: {what} {fmt_num(r.e2e_error)} > budget {budget:g} (local {local}"
        amp = r.e2e_output_error / r.local_error if r.local_error > 0 else math.nan
    elif units == "error" and r.cheap_estimate > budget:
        text = f"{p}: est. error {fmt_num(r.cheap_estimate)} > budget {budget:g} (local {local}"
        amp = r.cheap_estimate / r.local_error if r.local_error > 0 else math.nan
    else:
        return []
    if math.isfinite(amp) and amp >= 4:
        text += f", amplified x{amp:.0f} downstream"
    return [text + ")"]
