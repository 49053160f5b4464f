"""The gradient probes feed the training rule (probe/grad_rules.py): before any training
run, the probes name the one layer of examples/grad_hazard whose fp16 gradients flush —
eligible for fp16 with a GradScaler at γ = 1e-6, excluded from fp16 at γ = 1e-12."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autoprec.probe import probe
from autoprec.probe.grad_rules import grad_verdict
from autoprec.probe.table import ProbeRow
from autoprec.workload.loading import load_model_file

HAZARD = Path(__file__).resolve().parents[2] / "examples" / "grad_hazard" / "model.py"


@pytest.fixture(scope="module")
def spec():
    return load_model_file(HAZARD)


def _probe(spec, gamma: float):
    model = spec.build_model(gamma_init=gamma)
    return probe(model, spec.calibration_batches(), precisions=["fp16", "bf16", "fp8"],
                 forward=spec.forward, loss=spec.loss, progress=False)


def test_probes_name_the_layer_that_needs_loss_scaling(spec):
    table = _probe(spec, 1e-6)
    flagged = {(r.layer, r.precision) for r in table if "flush" in r.reason}
    assert flagged == {("branch", "fp16")}  # that layer, and only it
    row = table.row("branch", "fp16")
    assert row.grad_underflow > 0.9 and row.grad_underflow_scaled < 0.01
    assert not row.hard  # fp16 with the GradScaler stays a choice
    assert "needs the GradScaler" in row.reason
    # its forward is fine in fp16: the hazard is in the gradients only
    assert row.local_error < 1e-3 and row.overflow == 0
    assert grad_verdict(row).needs_scaler


def test_probes_exclude_a_layer_whose_gradients_flush_even_scaled(spec):
    table = _probe(spec, 1e-12)
    hard = table.hard_excluded()
    grads = {k: v for k, v in hard.items() if "gradients" in v}
    assert set(grads) == {("branch", "fp16")}
    assert "even with loss scale 65536" in grads[("branch", "fp16")]
    assert not table.row("branch", "bf16").hard  # bf16 has fp32's range: no flush
    assert not table.row("branch", "fp8").hard  # e5m2 is scaled per tensor


def _row(p: str, **kw) -> ProbeRow:
    r = ProbeRow(layer="l", precision=p, kind="linear")
    for k, v in kw.items():
        setattr(r, k, v)
    return r


@pytest.mark.parametrize("p, kw, hard, text", [
    ("fp8", dict(grad_underflow=0.3, grad_underflow_scaled=0.3, grad_error=0.1,
                 grad_error_scaled=0.1), True, "become 0 in e5m2"),
    ("fp8", dict(grad_underflow=0.0, grad_underflow_scaled=0.0, grad_error=0.7,
                 grad_error_scaled=0.7), True, "lose their signal"),
    ("fp8", dict(grad_underflow=0.0, grad_underflow_scaled=0.0, grad_error=0.04,
                 grad_error_scaled=0.04), False, ""),
    ("bf16", dict(grad_underflow=0.0, grad_underflow_scaled=0.0, grad_error=math.inf,
                  grad_error_scaled=math.inf), True, "non-finite gradients"),
    ("fp16", dict(grad_underflow=0.5, grad_underflow_scaled=0.0, grad_error=1.0,
                  grad_error_scaled=0.001), False, "needs the GradScaler"),
    ("fp16", dict(grad_underflow=0.0, grad_underflow_scaled=0.0, grad_error=0.001,
                  grad_error_scaled=0.9), True, "with loss scale 65536"),
    ("fp16", dict(grad_underflow=0.0, grad_underflow_scaled=0.0, grad_error=0.001,
                  grad_error_scaled=math.inf), False, "the GradScaler backs off"),
    ("fp16", dict(grad_underflow=0.0, grad_underflow_scaled=0.0, grad_error=math.inf,
                  grad_error_scaled=math.inf), True, "non-finite gradients"),
])
def test_the_rule(p, kw, hard, text):
    v = grad_verdict(_row(p, **kw))
    assert bool(v.hard) is hard
    assert text in "; ".join(v.hard + v.soft)


def test_no_verdict_without_gradient_probes():
    for p in ("fp16", "bf16", "fp8"):
        v = grad_verdict(_row(p))  # gradient columns NaN: probed without a loss
        assert not v.hard and not v.soft and not v.needs_scaler
