"""A stack where the precision boundaries decide: cheap compiled, dear eager (issue 23).

Layout (x: (B, D) -> (B, D)), ``BLOCKS`` blocks of

    h = h + fc_b(gelu(fc_a(h)))      # fc_a, fc_b: D -> D, ordinary: bf16 is fine
    h = norm(sens(h))                # sens: D -> D, its output rides a +256 offset that the
                                     #   LayerNorm removes: bf16's spacing at 256 is 2, the
                                     #   signal (std ~14) drowns (mixed8's ``offset``)

``sens`` must compute and write fp32, and so must the LayerNorm after it (CPU autocast runs
layer_norm in the low dtype): ``default: bf16`` is over budget and the feasible plans keep
the default fp32 with bf16 rules on ``fc_a``/``fc_b``. Each such rule is an island: its
input and weight cast in, its output cast back. Eager, every island costs its cast kernels
and the wrapper's Python on top of the GEMM's gain; compiled (inductor), the casts fuse into
the kernels around the GEMM and the wrapper is traced away. At this width (256) a bf16
GEMM gains about what its boundaries cost, so the two modes can choose differently
(``benchmarks/compile_winners.py``).
RANDOM INIT (seed 0), random inputs; default relative L2 error, no metric.
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAME = "compile_mix"
D, BLOCKS, BATCH = 256, 6, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_a = nn.Linear(D, D)
        self.fc_b = nn.Linear(D, D)
        self.sens = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.sens.weight.mul_(24.0)  # signal std ~ 14 ...
            self.sens.bias.fill_(256.0)  # ... riding a 256 offset

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, D)
        h = h + self.fc_b(torch.nn.functional.gelu(self.fc_a(h)))
        return self.norm(self.sens(h))


class CompileMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D)
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CompileMix().eval()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, D, generator=g) for _ in range(n)]  # each (B, D)


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 4)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 4)
