"""The training rule on the gradient probes: which (layer, precision) pairs a training tune
excludes before any training run, which need loss scaling, and why.

The gradient probes (``grads.py``) give, per (layer, precision), with the layer's true
fp32 ∂L/∂y from the loss backward of every calibration batch:

- ``grad_underflow``: the share of nonzero ∂L/∂y that become 0 when cast to the format the
  layer's backward reads them in (fp16 / bf16 as autocast casts them; fp8: e5m2 with
  per-tensor current scaling), without loss scaling; ``grad_underflow_scaled``: the same
  after multiplying by the GradScaler's initial scale (fp16 only; 2**16 by default);
- ``grad_error`` / ``grad_error_scaled``: the relative L2 error of the layer's backward
  (the gradients of its inputs and of its own weights) in that precision against fp32.

The rule (``GRAD_FLUSH_LIMIT``, ``GRAD_ERROR_LIMIT``; docs/training.md states it for users):

- **fp16**: training in fp16 always runs with a GradScaler (``autoprec.training.train`` creates one
  iff a layer computes in fp16). A layer whose ∂L/∂y flush at the scaler's initial scale
  (``grad_underflow_scaled >= GRAD_FLUSH_LIMIT``), whose backward is non-finite even
  unscaled, or whose scaled backward is off by ``GRAD_ERROR_LIMIT`` or more, is
  **excluded** from fp16. A backward finite unscaled but overflowing at the initial scale
  is a note: the scaler backs off (MiniLM's MLM head transform does this at 2**16). A layer whose
  gradients flush only *without* scaling stays eligible: its reason records that it needs
  the GradScaler (a loop that drops the scaler would lose that layer's gradients).
- **bf16, fp8 (e5m2), mxfp8**: no loss scaling applies (bf16 has fp32's exponent range;
  fp8 scales per tensor itself). A layer whose gradients flush in the format
  (``grad_underflow >= GRAD_FLUSH_LIMIT``) or whose backward is non-finite or off by
  ``GRAD_ERROR_LIMIT`` or more ("lost its signal") is **excluded** from it.
- Light flushing (at least ``GRAD_NOTE_FROM`` but under the limit) is a note, not an
  exclusion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoprec.formats.gemm import format_of
from autoprec.probe.table import ProbeRow

#: A share of nonzero ∂L/∂y at or above this that flush to zero excludes the pair (the same
#: share the forward probes' underflow rule uses: ``probe(underflow_limit=0.1)``).
GRAD_FLUSH_LIMIT = 0.10
#: A layer backward this far (relative L2) from fp32's has lost its gradient's signal: the
#: cosine between the low-precision and the true gradient is then at most ~0.87. fp8's own
#: rounding (2-bit e5m2 mantissa, 3-bit e4m3) cost ~0.04 on examples/grad_hazard's layers.
GRAD_ERROR_LIMIT = 0.5
#: Flushing from this share up (and under the limit) is noted in the reason.
GRAD_NOTE_FROM = 0.01
#: The GradScaler's initial scale the scaled figures refer to (torch's default).
DEFAULT_LOSS_SCALE = 2.0**16


@dataclass(frozen=True)
class GradVerdict:
    """What the rule says about one (layer, precision): ``hard`` reasons exclude the pair,
    ``soft`` ones are notes; ``needs_scaler``: fp16 trains only with loss scaling."""

    hard: tuple[str, ...] = ()
    soft: tuple[str, ...] = ()
    needs_scaler: bool = False


def grad_verdict(r: ProbeRow, loss_scale: float = DEFAULT_LOSS_SCALE,
                 flush_limit: float = GRAD_FLUSH_LIMIT,
                 error_limit: float = GRAD_ERROR_LIMIT) -> GradVerdict:
    """The rule of the module docstring on one probe row (no verdict without gradient
    probes: a row whose gradient columns are NaN)."""
    p = r.precision
    if math.isnan(r.grad_underflow) or p in ("fp32", "tf32"):
        return GradVerdict()
    hard: list[str] = []
    soft: list[str] = []
    needs_scaler = False
    raw, scaled = r.grad_underflow, r.grad_underflow_scaled
    if p == "fp16":
        err = r.grad_error_scaled
        if scaled >= flush_limit:
            hard.append(f"fp16: gradients flush, {scaled:.0%} of nonzero dL/dy below fp16's "
                        f"smallest subnormal (6e-08) even with loss scale {loss_scale:g}")
        elif raw >= flush_limit:
            needs_scaler = True
            soft.append(f"fp16: gradients flush without loss scaling ({raw:.0%} of nonzero "
                        f"dL/dy below 6e-08; {scaled:.0%} at scale {loss_scale:g}): needs "
                        "the GradScaler")
        elif raw >= GRAD_NOTE_FROM:
            soft.append(f"fp16: {raw:.0%} of nonzero dL/dy flush without loss scaling")
        what = f"with loss scale {loss_scale:g}"
    else:
        err = r.grad_error
        gf = format_of(p)  # a GEMM format's gradients: the first word of its recipe (fp8: e5m2)
        fmt = gf.gradient_recipe.split()[0] if gf is not None and gf.gradient_recipe else p
        if raw >= flush_limit:
            hard.append(f"{p}: gradients flush, {raw:.0%} of nonzero dL/dy become 0 in {fmt}")
        elif raw >= GRAD_NOTE_FROM:
            soft.append(f"{p}: {raw:.0%} of nonzero dL/dy flush in {fmt}")
        what = f"in {fmt}" if p != "bf16" else ""
    if hard:  # flushed: the error says the same thing again
        pass
    elif p == "fp16" and err == math.inf and r.grad_error != math.inf:
        # finite unscaled, inf at the initial scale: the GradScaler halves the scale on an
        # overflowing step (and skips it) until the gradients fit — a cost, not a hazard
        soft.append(f"fp16: gradients overflow at loss scale {loss_scale:g} (finite "
                    "unscaled): the GradScaler backs off, skipping a step each time")
    elif err == math.inf:
        hard.append(f"{p}: non-finite gradients {what}".rstrip())
    elif err >= error_limit:
        hard.append(f"{p}: gradients lose their signal, the layer's backward {what} is "
                    f"{err:.2g} (relative L2) from fp32's (limit {error_limit:g})"
                    .replace("  ", " "))
    return GradVerdict(tuple(hard), tuple(soft), needs_scaler)


def needs_scaler_layers(rows: list[ProbeRow]) -> dict[str, str]:
    """Layer -> reason, for layers whose fp16 gradients flush only without loss scaling."""
    out = {}
    for r in rows:
        v = grad_verdict(r)
        if v.needs_scaler:
            out[r.layer] = v.soft[0]
    return out


__all__ = ["DEFAULT_LOSS_SCALE", "GRAD_ERROR_LIMIT", "GRAD_FLUSH_LIMIT", "GRAD_NOTE_FROM",
           "GradVerdict", "grad_verdict", "needs_scaler_layers"]
