"""Training under a policy with nvfp4 layers: NVIDIA's NVFP4 recipe (lower.nvfp4_train)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from autoprec.lower.nvfp4_train import WEIGHT_ATTR
from autoprec.policy import Policy, PolicyWarning
from autoprec.training.train import fidelity_check, prepare_training, train_step


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 32))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 32, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(64, 32, generator=g)
        out.append((x, (x @ w).argmax(1)))  # a learnable labelling, 32 classes
    return out


def _loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def _fwd(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


@pytest.fixture(autouse=True)
def _quiet_policy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # hand-written: no fingerprint
        yield


def test_a_policy_with_nvfp4_layers_trains_and_the_loss_goes_down() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    policy = Policy(default="bf16", layers={"0": "nvfp4", "2": "nvfp4", "4": "nvfp4"})
    batches = _batches()
    with prepare_training(model, policy) as setup:
        assert setup.scaler is None  # per-block scales: no loss scaling
        assert setup.handle.format_backends == {"nvfp4": "train-emulated"}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        losses = [train_step(setup, opt, batches[i % 4], _loss, _fwd).loss for i in range(20)]
        assert WEIGHT_ATTR in model[2].__dict__  # the recipe's 16x16 weight ran
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 masters
    assert max(losses[-4:]) < 0.8 * losses[0], losses  # fp32: 3.48 -> 2.24..2.50
    # the masters moved as fp32 training moves them
    moved = (model[0].weight - ref[0].weight).detach()
    ropt = torch.optim.SGD(ref.parameters(), lr=1.0)
    for i in range(20):
        ropt.zero_grad()
        _loss(ref(batches[i % 4][0]), batches[i % 4]).backward()
        ropt.step()
    ref_moved = (ref[0].weight - _model()[0].weight).detach()
    cos = float(nn.functional.cosine_similarity(moved.flatten(), ref_moved.flatten(), 0))
    assert cos > 0.8, cos


def test_nvfp4_training_passes_the_fidelity_check() -> None:
    policy = Policy(default="fp32", layers={"0": "nvfp4", "2": "nvfp4"})
    rep = fidelity_check(_model, policy, _batches(), _loss, steps=20, lr=1e-2, forward=_fwd,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    assert not rep.diverged, rep.table()
    assert max(rep.policy_losses[-4:]) < 0.8 * rep.policy_losses[0]
