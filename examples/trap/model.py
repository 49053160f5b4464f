"""The mixed-failure model: no uniform low precision meets a 1% budget.

- ``blow`` produces activations around 1e5, past fp16's max of 65504: in fp16 they turn to
  inf and the next LayerNorm to NaN; bf16 (fp32's range) is fine.
- ``offset`` writes a small signal riding a +256 offset that the next LayerNorm removes:
  bf16 keeps 8 significant bits, so at 256 its spacing is 2 and the signal is lost; fp16's
  spacing there is 0.25 (1.46% error after the next LayerNorm with CPU autocast, as
  docs/overview.md records under "Facts seen") — within a few-percent budget.
- the other layers are ordinary and take any precision.
So the tuned policy must put ``blow`` in bf16 (or fp32) and ``offset`` in fp16 (or fp32).
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAME = "trap"
WIDTH = 256


class Trap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, WIDTH)
        self.blow = nn.Linear(WIDTH, WIDTH)
        self.norm1 = nn.LayerNorm(WIDTH)
        self.mid1 = nn.Linear(WIDTH, WIDTH)
        self.offset = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mid2 = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 16)
        with torch.no_grad():
            self.blow.weight.mul_(2e5)  # max |y| ~ 1e6 > 65504 on typical inputs
            self.offset.weight.mul_(64.0)  # signal std ~ 13 ...
            self.offset.bias.fill_(256.0)  # ... riding a 256 offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 64)
        h = torch.relu(self.inp(x))  # (B, 256)
        h = self.norm1(self.blow(h))
        h = torch.nn.functional.gelu(self.mid1(h))
        h = self.norm2(self.offset(h))
        h = torch.nn.functional.gelu(self.mid2(h))
        return self.head(h)  # (B, 16)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Trap()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 64, generator=g) for _ in range(n)]


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 4)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 4)
