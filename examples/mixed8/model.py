"""An 8-GEMM net where fp16 overflows one layer and bf16 drowns another (issue 13/14).

Layout (x: (B, 64) -> (B, 16)), the GEMMs in execution order:

    embed 64->512, wide1 512->1024, wide2 1024->512, range_block 512->512   "the head"
    offset 512->512, tail1 512->512, tail2 512->512, head 512->16           "the tail"

- ``range_block`` writes activations around 1e5, past fp16's 65504: in fp16 they turn to
  inf (and the next LayerNorm to NaN); bf16 keeps fp32's range.
- ``offset`` writes a small signal riding a +256 offset that the next LayerNorm removes:
  bf16's spacing at 256 is 2 (8 significant bits), so the signal drowns; fp16's is 0.25.
- the rest are ordinary. So no uniform 16-bit precision fits a few-percent budget, and the
  fast plan is a bf16 head and a fp16 tail with one boundary between them: the search has to
  cross plans where one-layer steps each add a cast boundary (issue 14).

Activations between the GEMMs are the model's own code (GELU, a residual add, LayerNorms),
so a plan's region for non-GEMM code matters to its price (issue 13).
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAME = "mixed8"


class Mixed8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 512)
        self.wide1 = nn.Linear(512, 1024)
        self.wide2 = nn.Linear(1024, 512)
        self.range_block = nn.Linear(512, 512)
        self.norm1 = nn.LayerNorm(512)
        self.offset = nn.Linear(512, 512)
        self.norm2 = nn.LayerNorm(512)
        self.tail1 = nn.Linear(512, 512)
        self.tail2 = nn.Linear(512, 512)
        self.head = nn.Linear(512, 16)
        with torch.no_grad():
            self.range_block.weight.mul_(2e5)  # max |y| ~ 1e6 > 65504
            self.offset.weight.mul_(24.0)  # signal std ~ 14 ...
            self.offset.bias.fill_(256.0)  # ... riding a 256 offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 64)
        h = torch.nn.functional.gelu(self.embed(x))  # (B, 512)
        h = h + self.wide2(torch.nn.functional.gelu(self.wide1(h)))  # residual, (B, 512)
        h = self.norm1(self.range_block(h))
        h = self.norm2(self.offset(h))
        h = h + self.tail2(torch.nn.functional.gelu(self.tail1(h)))
        return self.head(h)  # (B, 16)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Mixed8().eval()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 64, generator=g) for _ in range(n)]  # each (64, 64)


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 4)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 4)
