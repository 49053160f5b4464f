"""Training under a policy: GradScaler iff fp16, fp32 masters, skipped steps, fidelity."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from autoprec.errors import InputError
from autoprec.policy import Policy, PolicyWarning
from autoprec.training.train import (
    fidelity_check,
    needs_grad_scaler,
    prepare_training,
    train_step,
)
from tests.zoo import ReluMLP


def _mlp(seed: int = 0) -> ReluMLP:
    torch.manual_seed(seed)
    return ReluMLP()


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append((x, (x @ w).argmax(1)))  # a learnable labelling
    return out


def _loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _fwd(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def _acc(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    return float((outputs.argmax(1) == batch[1]).float().mean())


def _policy(**layers: str) -> Policy:
    return Policy(default="fp32", layers=layers)


@pytest.fixture(autouse=True)
def _quiet_policy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # hand-written: no fingerprint
        yield


@pytest.mark.parametrize(("layers", "expected"), [
    ({"fc1": "fp16"}, True),
    ({"": "fp16", "head": "fp32"}, True),
    ({"fc1": "bf16", "fc2": "bf16"}, False),
    ({}, False),
])
def test_grad_scaler_iff_policy_has_fp16(layers: dict[str, str], expected: bool) -> None:
    model = _mlp()
    policy = _policy(**layers)
    assert needs_grad_scaler(policy, model) is expected
    with prepare_training(model, policy) as setup:
        assert (setup.scaler is not None) is expected
        if expected:
            assert isinstance(setup.scaler, torch.amp.GradScaler)
            assert setup.scale == 2.0**16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_non_fp32_parameters_refused_with_their_name(dtype: torch.dtype) -> None:
    model = _mlp()
    model.fc2.weight.data = model.fc2.weight.data.to(dtype)
    with pytest.raises(InputError, match=r"'fc2\.weight'.*fp32 master"):
        prepare_training(model, _policy(fc1="fp16"))
    # Refused before anything was installed: the class forwards show through.
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_masters_stay_fp32_while_fp16_computes() -> None:
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    setup = prepare_training(model, _policy(fc1="fp16", fc2="fp16"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches()
    for b in batches:
        res = train_step(setup, opt, b, _loss, forward=_fwd)
        assert res.scale is not None and not res.skipped
    report = setup.handle.audit(lambda: model(batches[0][0]))
    computed = {r.layer: r.computed for r in report.rows}
    assert computed == {"fc1": "fp16", "fc2": "fp16", "head": "fp32"}
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert not torch.equal(p.detach(), before[name]), f"{name} was not updated"
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float32
        assert state["exp_avg_sq"].dtype == torch.float32
    assert setup.steps == len(batches) and setup.skipped_steps == 0
    setup.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_overflowing_gradients_skip_the_step_and_halve_the_scale() -> None:
    model = _mlp()
    # A scale of 2**40 makes the scaled fp16 gradients overflow (max 65504).
    setup = prepare_training(model, _policy(fc1="fp16"), init_scale=2.0**40)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = model.fc1.weight.detach().clone()
    res = train_step(setup, opt, _batches(1)[0], _loss, forward=_fwd)
    assert res.skipped and res.scale == 2.0**39
    assert torch.equal(model.fc1.weight.detach(), w)  # no update from inf gradients
    assert setup.skipped_steps == 1


def test_gradients_are_unscaled_before_clipping() -> None:
    batch = _batches(1)[0]
    ref = _mlp()
    plain = prepare_training(ref, _policy())
    r_ref = train_step(plain, torch.optim.SGD(ref.parameters(), lr=0.0), batch, _loss,
                       forward=_fwd, max_grad_norm=1e9)
    low = _mlp()
    scaled = prepare_training(low, _policy(fc1="fp16", fc2="fp16"))
    r_low = train_step(scaled, torch.optim.SGD(low.parameters(), lr=0.0), batch, _loss,
                       forward=_fwd, max_grad_norm=1e9)
    assert scaled.scaler is not None and plain.scaler is None
    # The true norm, not 65536 times it; fp16 rounding only.
    assert r_low.grad_norm == pytest.approx(r_ref.grad_norm, rel=1e-2)


def test_fidelity_check_passes_a_sound_policy() -> None:
    batches = _batches()
    rep = fidelity_check(_mlp, _policy(fc1="fp16", fc2="fp16"), batches, _loss, steps=12,
                         lr=1e-2, forward=_fwd, eval_batches=batches, metric=_acc)
    assert not rep.diverged, rep.reasons
    assert len(rep.fp32_losses) == len(rep.policy_losses) == 12
    assert rep.fp32_losses[0] == pytest.approx(rep.policy_losses[0], rel=1e-2)  # same init
    assert rep.final_scale is not None and rep.skipped_steps == 0
    assert rep.fp32_losses[-1] < rep.fp32_losses[0]  # it did train
    assert "diverged if" in rep.rule and "step" in rep.table()


def test_fidelity_check_flags_a_divergent_policy() -> None:
    def build() -> ReluMLP:
        model = _mlp()
        with torch.no_grad():
            model.fc1.weight.mul_(1e5)  # fc1's outputs reach ~1e5: past fp16's 65504
        return model

    rep = fidelity_check(build, _policy(fc1="fp16"), _batches(), _loss, steps=8, lr=1e-3,
                         forward=_fwd)
    assert rep.diverged
    assert any("non-finite policy loss" in r for r in rep.reasons), rep.reasons
    assert all(torch.isfinite(torch.tensor(x)) for x in rep.fp32_losses)  # fp32 is fine
    assert rep.to_dict()["diverged"] is True


def test_fidelity_check_flags_a_metric_drop() -> None:
    batches = _batches()
    # An impossible bar: any training noise at all counts as a drop.
    rep = fidelity_check(_mlp, _policy(fc1="fp16"), batches, _loss, steps=4, lr=1e-2,
                         forward=_fwd, eval_batches=batches,
                         metric=lambda o, b: -float(o.float().abs().sum()), max_drop=-1e9)
    assert rep.diverged and any("metric after training" in r for r in rep.reasons)


def test_fidelity_check_input_errors() -> None:
    with pytest.raises(InputError, match="steps >= 1"):
        fidelity_check(_mlp, _policy(), _batches(), _loss, steps=0)
    with pytest.raises(InputError, match="together"):
        fidelity_check(_mlp, _policy(), _batches(), _loss, steps=1, metric=_acc)


def test_fidelity_check_spec_uses_model_py_parts(tmp_path) -> None:
    from autoprec.training.train import fidelity_check_spec
    from autoprec.workload.loading import ModelSpec

    batches = _batches()
    spec = ModelSpec(path=tmp_path / "model.py", name="mlp", build_model=_mlp,
                     calibration_data=lambda: batches, eval_data=lambda: batches[:2],
                     forward=_fwd, metric=_acc, loss=_loss)
    rep = fidelity_check_spec(spec, _policy(fc1="fp16"), steps=6, lr=1e-2)
    assert not rep.diverged and rep.fp32_metric is not None and rep.steps == 6
    with pytest.raises(InputError, match="loss"):
        fidelity_check_spec(ModelSpec(path=spec.path, name="mlp", build_model=_mlp,
                                      calibration_data=lambda: batches), _policy(), steps=1)


def test_block_scaled_layers_prepare_for_training_without_a_scaler() -> None:
    """mxfp8 and nvfp4 layers train (nvfp4: NVIDIA's recipe, tests/train/test_train_nvfp4.py)."""
    from autoprec.policy import Policy
    from autoprec.training.train import prepare_training

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    with prepare_training(model, Policy(default="bf16", layers={"0": "nvfp4"})) as setup:
        assert setup.handle.format_backends == {"nvfp4": "train-emulated"}
    with prepare_training(model, Policy(default="bf16", layers={"0": "mxfp8"})) as setup:
        assert setup.scaler is None  # no fp16 anywhere: no loss scaling
