"""A two-block GPT-style decoder small enough to evaluate hundreds of times on a CPU.

Model: nanoGPT's block (pre-LayerNorm, causal SDPA attention, GELU MLP with 4x width):
n_embd 1024, 2 layers, 16 heads (head dim 64), vocabulary 512, context 32, untied lm_head.
Every GEMM is 16-aligned, so every Linear may take fp8. RANDOM INIT (seed 0, GPT-2's
N(0, 0.02) with the residual projections scaled by 1/sqrt(2 * n_layer)).

One deliberate quirk, as in T5's feed-forward blocks (transformers#9295): the first block's
MLP has a few hidden channels whose pre-activations reach ~1e5, past fp16's max of 65504;
``mlp.c_proj`` reads them through weights scaled down by the same factor, so their
contribution to the residual stream is ordinary. In fp16 ``h.0.mlp.c_fc`` overflows, and
``h.0.mlp.c_proj`` overflows when it casts its input to fp16; bf16 (fp32's range) is fine.
Everything else is a plain random-init transformer, where the layers differ only mildly.

Data: seeded random token ids, batches of 2 sequences x 32 tokens; calibration = 2 batches,
eval = 2 batches of 4 sequences from another seed. Outputs: logits ``(B, T, 512)``, scored
by autoprec's default relative L2 error. Loss: next-token cross-entropy (gradient probes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "tinygpt"
VOCAB, CONTEXT, N_EMBD, N_HEAD, N_LAYER = 512, 32, 1024, 16, 2
HOT_CHANNELS = (5, 77, 2901)  # hidden channels of h.0.mlp that carry ~1e5 activations
HOT_SCALE = 3e4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(CONTEXT, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) token ids
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 2 and "ln" not in name:
                # GPT-2 init: N(0, 0.02); residual projections / sqrt(2 * n_layer) (nanoGPT)
                std = 0.02 / math.sqrt(2 * N_LAYER) if name.endswith("c_proj.weight") else 0.02
                p.normal_(0.0, std)
        mlp = model.h[0].mlp
        for ch in HOT_CHANNELS:
            # ln_2's output has unit scale, so a row of norm ~HOT_SCALE * sqrt(C) * 0.02
            # gives pre-activations of ~1e5 on typical tokens; a positive bias keeps them
            # positive (GELU passes them through) ...
            mlp.c_fc.weight[ch].mul_(HOT_SCALE / 4)
            mlp.c_fc.bias[ch] = 1e5
            # ... and c_proj reads them scaled down by the same factor.
            mlp.c_proj.weight[:, ch].div_(1e5)
    return model.eval()


def _batches(seed: int, n: int, b: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (b, CONTEXT), generator=g) for _ in range(n)]  # (B, T)


def calibration_data() -> list[torch.Tensor]:
    return _batches(1, 2, 2)


def eval_data() -> list[torch.Tensor]:
    return _batches(2, 2, 4)


def loss(outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    # Position t predicts token t + 1: logits[:, :-1] against ids[:, 1:].
    logits = outputs[:, :-1].float()  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
