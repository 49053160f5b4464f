"""Models for the probe tests. Hand-built layers whose behaviour under each format is known, and tiny HF models.

``Known`` holds four independent branches, each a Linear whose numbers are chosen so one
format fails it for a known reason (values from the IEEE/OCP format limits):

- ``big``: outputs ~3e5 > 65504 (fp16 max): fp16 overflows to inf; bf16 keeps fp32's range.
- ``offset``: outputs 64 + N(0, 4²), then a LayerNorm that removes the 64. bf16 spacing at
  64 is 0.5 (8-bit mantissa) -> rounding noise 0.5/sqrt(12) = 0.14, i.e. ~3.6% of the
  signal after the norm; fp16's spacing there is 1/16 -> ~0.45%. The Linear's own output
  error is ~0.2% in bf16: only the downstream view (estimate / end to end) sees it.
- ``tiny``: weights ~1e-9 and outputs ~1e-8, below fp16's smallest subnormal (6e-8):
  fp16 flushes them to zero; bf16 has fp32's exponent range.
- ``robust``: a plain Linear, fine in every format but fp8 (3 mantissa bits, ~4% error).

Each branch is rescaled to O(1) and the model returns a dict with non-tensor members.
"""

from __future__ import annotations

import torch
from torch import nn

B = 16  # samples per batch: the estimate averages over samples


class Known(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Linear(16, 16)
        self.offset = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16, elementwise_affine=False)
        self.tiny = nn.Linear(16, 16)
        self.robust = nn.Linear(16, 16)
        with torch.no_grad():
            w = torch.randn(16, 16) / 4.0  # (out, in): unit-variance outputs for N(0,1) inputs
            self.big.weight.copy_(w * 3e5)
            self.big.bias.zero_()
            self.offset.weight.copy_(w * 4.0)
            self.offset.bias.fill_(64.0)
            self.tiny.weight.copy_(w * 1e-8)
            self.tiny.bias.zero_()

    def forward(self, x: torch.Tensor) -> dict:  # x: (B, 16)
        return {
            "big": self.big(x) / 3e5,
            "offset": self.norm(self.offset(x)),
            "tiny": self.tiny(x) * 1e8,
            "robust": self.robust(x),
            "name": "known",  # non-tensor members are skipped
            "nothing": None,
        }


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16)
    return BertModel(cfg).eval()


def tiny_gpt2(use_cache: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                     use_cache=use_cache, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def ids(n: int = 2, b: int = 4, t: int = 8, vocab: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (b, t), generator=g)} for _ in range(n)]
