"""A gradient-only hazard: a model whose forward is fine in fp16 but one layer's gradients
underflow fp16 without loss scaling.

A small residual MLP with a LayerScale branch (ConvNeXt and CaiT initialise the per-channel
scale γ at 1e-6): ``h = h + γ * branch(h)``. The branch's output is an ordinary O(1)
activation — fp16 holds it, its forward error is that of any fp16 Linear — but the gradient
reaching it is γ · ∂L/∂h ≈ 1e-6 · 1e-3: below fp16's smallest subnormal (2**-24 ≈ 6e-8), so
an unscaled fp16 backward of ``branch`` sees zeros. A GradScaler's 2**16 lifts it back into
range; with ``GAMMA_INIT`` 1e-12 (``build_model(gamma_init=1e-12)``) nothing does, and the
layer cannot train in fp16 at all. Every other layer's gradients are ~1e-3: no hazard.

Data: a fixed random regression (inputs (64, 32), targets (64, 8) from a fixed teacher);
``loss`` is the mean squared error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "grad_hazard"
GAMMA_INIT = 1e-6  # ConvNeXt's layer_scale_init_value
HAZARD_LAYER = "branch"  # the one layer whose fp16 gradients flush without scaling


class HazardNet(nn.Module):
    def __init__(self, gamma_init: float = GAMMA_INIT) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.branch = nn.Linear(64, 64)
        self.gamma = nn.Parameter(torch.full((64,), gamma_init))  # LayerScale
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))  # (B, 64)
        h = h + F.gelu(self.mid(h))
        h = h + self.gamma * self.branch(h)  # dL/d branch(h) = gamma * dL/dh ~ 1e-9
        return self.head(h)  # (B, 8)


def build_model(gamma_init: float = GAMMA_INIT) -> nn.Module:
    torch.manual_seed(0)
    return HazardNet(gamma_init).eval()


def _data(seed: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in range(n_batches):
        x = torch.randn(64, 32, generator=gen)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def calibration_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _data(0, 4)


def eval_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _data(1, 2)


def forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(outputs.float(), batch[1])
