"""The short-run contract (autoprec/training/short_run.py): N steps from one init on the
calibration batches, the eval loss against fp32's within a relative gap — on real
optimizers and real low-precision arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.errors import InputError
from autoprec.policy import Policy
from autoprec.training.short_run import ShortRunCheck
from autoprec.workload.loading import load_model_file

HAZARD = Path(__file__).resolve().parents[2] / "examples" / "grad_hazard" / "model.py"


def _precise():
    """A linear regression started next to its exact solution: fp32 drives the loss to
    ~0, a bf16 forward (8-bit mantissa) leaves ~1e-4 of rounding error in every output."""
    torch.manual_seed(0)
    teacher = torch.randn(8, 32)
    model = nn.Linear(32, 8, bias=False)
    with torch.no_grad():
        model.weight.copy_(teacher + 1e-3 * torch.randn(8, 32))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 32, generator=gen) for _ in range(4)]
    return model, [(x, x @ teacher.T) for x in xs]


def _mse(out, batch):
    return F.mse_loss(out.float(), batch[1])


def _fwd(model, batch):
    return model(batch[0])


def test_fp32_is_its_own_reference_and_bf16_passes_a_tolerant_model():
    spec = load_model_file(HAZARD)
    check = ShortRunCheck.from_spec(spec, steps=8, lr=1e-3)
    ref = check.check(None)
    assert ref.passed and ref.gap == 0.0 and ref.run is ref.fp32
    bf16 = check.check(Policy(default="bf16", form="train"), "bf16 autocast")
    assert bf16.passed, bf16.reasons
    assert abs(bf16.gap) <= 0.01 and bf16.run.eval_loss != ref.fp32.eval_loss  # it ran bf16
    assert not bf16.run.scaler
    fp16 = check.check(Policy(default="fp16", form="train"), "fp16 autocast")
    assert fp16.run.scaler  # fp16=True: a GradScaler
    assert len(fp16.run.losses) == 8
    # cached: asking again runs nothing
    seconds = check.seconds
    assert check.check(Policy(default="bf16", form="train")) is bf16 and check.seconds == seconds


def test_a_plan_that_trains_worse_than_fp32_fails_with_the_figures():
    model, batches = _precise()
    check = ShortRunCheck(lambda: model, batches[:3], _mse, eval_batches=batches[3:],
                          forward=_fwd, steps=16, lr=1e-3, max_loss_gap=0.01)
    v = check.check(Policy(default="bf16", form="train"))
    assert not v.passed
    assert v.gap > 0.01 and v.run.eval_loss > v.fp32.eval_loss
    assert "eval loss" in v.why_not() and "> 1.00%" in v.why_not()
    # a looser contract passes the same run (the figure, not the verdict, is the fact)
    loose = ShortRunCheck(lambda: model, batches[:3], _mse, eval_batches=batches[3:],
                          forward=_fwd, steps=16, lr=1e-3, max_loss_gap=v.gap * 2)
    assert loose.check(Policy(default="bf16", form="train")).passed


def test_emulated_16_bit_gemms_train_as_the_cpu_kernels_do(monkeypatch):
    """Wide16 (fp32 GEMMs of 16-bit operands, rounded) in forward and backward: the losses
    match the CPU's own fp16 kernels to fp16 rounding, and the GEMMs were computed wide."""
    spec = load_model_file(HAZARD)
    pol = Policy(default="fp16", form="train")
    runs = {}
    for forced in ("1", "0"):
        monkeypatch.setenv("AUTOPREC_WIDE16", forced)
        from autoprec.lower import wide16

        wide16.slow_dtypes.cache_clear()
        runs[forced] = ShortRunCheck.from_spec(spec, steps=4, lr=1e-3).check(pol).run
    wide16.slow_dtypes.cache_clear()
    assert runs["1"].wide_gemms > 0 and runs["0"].wide_gemms == 0
    for a, b in zip(runs["1"].losses, runs["0"].losses):
        assert a == pytest.approx(b, rel=2e-3)
    assert runs["1"].eval_loss == pytest.approx(runs["0"].eval_loss, rel=2e-3)


@pytest.mark.parametrize("kw, msg", [(dict(steps=0), "--train-steps"),
                                     (dict(max_loss_gap=-1.0), "--max-loss-gap")])
def test_bad_settings_are_one_line(kw, msg):
    model, batches = _precise()
    with pytest.raises(InputError, match=msg):
        ShortRunCheck(lambda: model, batches, _mse, forward=_fwd, **kw)
