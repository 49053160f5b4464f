"""A new user's encoder: 4 BERT blocks of width 256, random init, random tokens.

What a user writes on day one to try autoprec on "something like my model": a
``transformers`` BertModel from a config (hidden 256, 4 layers, 4 heads, FFN 1024,
vocabulary 1000), seeded random weights, batches of 8 sequences of 32 random token ids
(2 calibrate, 2 evaluate); the outputs are the last hidden states, so the budget is the
default relative L2 error. Tuned at its calibration batch (8 sequences): on a GPU profile
that small batch is where per-call weight casts decide whether 16 bits pay
(benchmarks/deploy_form.py).
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAME = "encoder4"
BATCH, SEQ, VOCAB = 8, 32, 1000


def build_model() -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=4, intermediate_size=1024,
                     max_position_embeddings=64)
    torch.manual_seed(0)
    return BertModel(cfg, add_pooling_layer=False).float().eval()


def _batches(seed: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)} for _ in range(n)]


def calibration_data() -> list[dict[str, torch.Tensor]]:
    return _batches(1, 2)


def eval_data() -> list[dict[str, torch.Tensor]]:
    return _batches(2, 2)


def forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).last_hidden_state  # (B, T, 256)
