"""A 2048-wide 4-block MLP where fp8 pays on most GEMMs at a deployment batch (issue 13).

Layout (x: (B, 256) -> (B, 16)): ``inp`` 256->2048, four pre-norm residual blocks
(LayerNorm, ``fc1`` 2048->2048, GELU, ``fc2`` 2048->2048, + residual), a final LayerNorm
and ``head`` 2048->16. The 8 block GEMMs are large and 16-aligned: at tens of thousands of
rows their fp8 GEMM time saves more than the amax and cast passes cost. ``inp`` (K = 256)
and ``head`` (N = 16) are small: fp8 costs more there than it saves (docs/overview.md).

Inputs carry outlier channels (every 64th feature x 50, as in LLM activations), so
per-tensor scaling (fp8) and per-block scaling (MXFP8 / NVFP4, issue 17) differ on ``inp``.
RANDOM INIT (seed 0), random inputs; default relative L2 error, no metric.
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAME = "wide"
WIDTH = 2048
IN_FEATURES = 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2048)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 256)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (B, 16)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Wide().eval()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(64, IN_FEATURES, generator=g)  # (64, 256)
        x[:, ::64] *= 50.0  # outlier channels
        out.append(x)
    return out


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 4)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 4)
