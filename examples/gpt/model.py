"""A GPT-2-style decoder at a realistic shape for the cost model, small enough for a CPU.

Model: HF ``GPT2LMHeadModel`` from a ``GPT2Config`` — n_embd 512, 4 layers, 8 heads
(head dim 64), MLP 2048, vocabulary 1024, context 64, lm_head tied to the token embedding
(GPT-2's default). RANDOM INIT (seed 0): no GPT weights can be fetched here, and the point
is the layer shapes (every GEMM 16-aligned, so fp8-eligible) and how their errors compound,
not what the model says. ``use_cache=False``: no KV cache in the outputs, and
``torch.export`` traces GPT-2 only without it (docs/overview.md).

Data: random token ids (seeded), batches of B=4 sequences of T=64 tokens; calibration and
eval are 2 batches each from different seeds. Random tokens are as good as text for a
random-weight model.

Outputs: logits ``(B, T, 1024)``, scored by autoprec's default relative L2 error against
fp32. No ``metric``: next-token agreement with fp32 would need the fp32 reference, which the
contract's ``metric(outputs, batch)`` does not see. Loss: next-token cross-entropy on the
batch's own tokens (enables gradient probes; ~ln(1024) = 6.9 at random init).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "gpt"
VOCAB, CONTEXT = 1024, 64
B, T = 4, 64


def build_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=512,
        n_layer=4,
        n_head=8,
        n_inner=2048,  # 4 * n_embd, GPT-2's ratio
        use_cache=False,
        # GPT-2's 50256 (<|endoftext|>) lies outside this vocabulary; no generation here.
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).float().eval()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (B, T), generator=g) for _ in range(n)]  # each (B, T)


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 2)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 2)


def forward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch).logits  # (B, T, V)


def loss(outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    # Position t predicts token t+1: logits[:, :-1] against ids[:, 1:].
    logits = outputs[:, :-1].float()  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
