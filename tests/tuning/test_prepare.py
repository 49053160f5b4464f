"""tune's first stage: the model's two fp32 reference runs may differ by rounding noise far
under the budget (CPU GEMM kernels may round differently run to run), said in one warning
line with its size; a difference that could change a decision is refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import autoprec
from autoprec.errors import InputError, PolicyWarning


class Jittery(nn.Module):
    """Two Linears whose output moves by ``rel`` (relative) from run to run, as a kernel
    that rounds differently each call would move it."""

    def __init__(self, rel: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.rel = nn.Linear(32, 64), nn.Linear(64, 16), rel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 32) -> (B, 16)
        y = self.fc2(torch.relu(self.fc1(x)))
        return y * (1 + self.rel * torch.randn(y.shape))  # unseeded: differs every run


def _tune(rel: float, tmp_path: Path) -> object:
    calib = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return autoprec.tune(Jittery(rel), calibration=calib, max_error=0.01, target="h100",
                         trials=2, out=tmp_path / "p.yaml", progress=False)


def test_rounding_noise_far_under_the_budget_is_accepted_and_said(tmp_path: Path) -> None:
    with pytest.warns(PolicyWarning, match=r"two runs differ by [0-9.e-]+ \([0-9.e-]+ of "
                                           r"the budget 0\.01; .*accepted as noise"):
        res = _tune(1e-7, tmp_path)
    assert (tmp_path / "p.yaml").is_file() and res.path == tmp_path / "p.yaml"


def test_a_difference_that_could_change_a_decision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"not deterministic \(two runs differ by .*more "
                                         r"than 0\.001 x the budget 0\.01"):
        _tune(1e-4, tmp_path)
    assert not (tmp_path / "p.yaml").exists()
