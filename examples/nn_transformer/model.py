"""torch.nn's own transformer blocks: ``nn.TransformerEncoder`` (3 x ``TransformerEncoderLayer``,
d=192, 6 heads, FFN 768, batch_first) over token embeddings, mean-pooled into a 10-way head.

Why it is here: in eval mode under ``no_grad`` torch runs these blocks through fused
kernels (``torch._transformer_encoder_layer_fwd``, ``torch._native_multi_head_attention``)
that compute with ``linear1``/``linear2``/``out_proj``'s weights without calling them as
modules, and ``nn.MultiheadAttention`` never calls ``out_proj`` at all. A policy's rules on
those modules must run (autoprec turns the fused paths off while a policy is applied) or be
refused by name; this model is how the tests and the README show it. Random init (seed 0),
random token ids (seed 1): the shapes and the code paths are the point.
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAME = "nn_transformer"
VOCAB, D, HEADS, FFN, LAYERS, T, BATCH = 1000, 192, 6, 768, 3, 32, 8


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, T)
        h = self.encoder(self.embed(ids))  # (B, T, D)
        return self.head(h.mean(dim=1))  # (B, 10)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Encoder().eval()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, T), generator=g) for _ in range(n)]


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 2)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 4)
