"""Tiny models for tests, built offline from configs (never downloaded).

Each builder returns a ``Case``: the model (fp32, eval mode, seeded), one example batch
and the sizes a test needs for hand counts. Sizes are small so a forward takes
milliseconds on a CPU; dims are chosen so some Linear layers are fp8-eligible (multiples
of 16) and some are not (e.g. a vocabulary of 100).

Import from other tests as ``from tests.zoo import bert, mlp`` (tests/conftest.py puts the
repository root on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

B, T = 2, 8  # batch (sequences/images) and sequence length of every text batch


@dataclass
class Case:
    """A tiny model, one example batch, and the sizes behind its hand counts."""

    name: str
    model: nn.Module
    batch: Any
    dims: dict[str, int] = field(default_factory=dict)
    forward: Callable[[nn.Module, Any], Any] | None = None  # None: autoprec's default


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)  # (B, T)


def _ready(model: nn.Module) -> nn.Module:
    return model.float().eval()


# --------------------------------------------------------------------------- plain torch


class MLP(nn.Module):
    """fc1 (100 -> 64: in_features not a multiple of 16), fc2 (64 -> 32: fp8-eligible),
    head (32 -> 10: out_features not a multiple of 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(100, 64)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 32)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 100)
        return self.head(self.drop(self.fc2(self.norm(self.act(self.fc1(x))))))  # (B, 10)


def mlp() -> Case:
    torch.manual_seed(0)
    return Case("mlp", _ready(MLP()), torch.randn(B, 100), {"B": B})


class Branchy(nn.Module):
    """Data-dependent control flow: which branch runs depends on the input's values, so
    fx (and export without torch.cond) cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.pos = nn.Linear(32, 32)
        self.neg = nn.Linear(32, 16)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 32)
        h = torch.relu(self.inp(x))
        if h.sum() > 0:  # noqa: SIM108 - data-dependent: a Python bool of a tensor
            h = self.pos(h)
        else:
            h = torch.cat([self.neg(h), self.neg(h)], dim=-1)
        return self.out(h)  # (B, 8)


def branchy() -> Case:
    torch.manual_seed(0)
    x = torch.randn(B, 32).abs() + 1.0  # positive: the `pos` branch runs; `neg` never does
    model = _ready(Branchy())
    with torch.no_grad():  # make sure relu(inp(x)) sums > 0
        model.inp.bias.fill_(1.0)
    return Case("branchy", model, x, {"B": B})


class Shared(nn.Module):
    """One Linear called twice (calls == 2) and an embedding tied to the output head."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.act = nn.ReLU()
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied weights: same Parameter in two modules

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, T)
        h = self.emb(ids)  # (B, T, C)
        h = self.block(self.act(self.block(h)))  # the same module twice
        return self.head(h)  # (B, T, vocab)


def shared() -> Case:
    torch.manual_seed(0)
    return Case("shared", _ready(Shared()), _ids(64), {"B": B, "T": T, "C": 32, "V": 64})


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)  # (B, 3, 16, 16) -> (B, 8, 16, 16)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)  # -> (B, 8, 8, 8)
        self.conv2 = nn.Conv2d(8, 16, 3)  # -> (B, 16, 6, 6)
        self.fc = nn.Linear(16 * 6 * 6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.act(self.bn(self.conv1(x))))
        h = torch.relu(self.conv2(h))
        return self.fc(h.flatten(1))  # (B, 16)


def cnn() -> Case:
    torch.manual_seed(0)
    return Case("cnn", _ready(CNN()), torch.randn(B, 3, 16, 16), {"B": B, "H": 16})


class GeluChain(nn.Module):
    """x -> fcs.0 -> gelu -> fcs.1 -> gelu -> ...: ``n`` Linears (d -> d) with the model's
    own code between every pair of GEMMs, so a one-layer change adds a cast boundary (the
    coupling that stops a walk of one-layer steps short of the faster plan)."""

    def __init__(self, n: int = 5, d: int = 512) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d) -> (B, d)
        for fc in self.fcs:
            x = torch.nn.functional.gelu(fc(x))
        return x


class ReluMLP(nn.Module):
    """fc1 (16 -> hidden), fc2 (hidden -> 32), head (32 -> 4), ReLUs between: small enough
    to train in a test. tests/check/fixtures/mlp_model.py is the same net as a model.py
    (a model.py stands alone, so it keeps its own copy)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 16)
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))  # (B, 4)


# ------------------------------------------------------------ torch.nn's own transformers
# Their eval/no_grad fused paths skip module calls, and nn.MultiheadAttention never calls
# out_proj (autoprec/fused.py): these models are how the tests hold apply to that.


def _star(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    return model(*batch)


class NNEncoder(nn.Module):
    """nn.TransformerEncoder (2 layers, d=32, 2 heads, batch_first) with a padding mask,
    nested tensors enabled (torch's default), a 10-way head."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:  # (B, T, 32)
        return self.head(self.encoder(x, src_key_padding_mask=pad))  # (B, T, 10)


def nn_encoder() -> Case:
    torch.manual_seed(0)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, T - 3:] = True  # the second sequence is 3 tokens shorter
    return Case("nn_encoder", _ready(NNEncoder()), (torch.randn(B, T, 32), pad),
                forward=_star)


def nn_seq2seq() -> Case:
    """nn.Transformer encoder-decoder (1 + 1 layers, d=32): self- and cross-attention."""
    torch.manual_seed(0)
    model = _ready(nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True))
    return Case("nn_seq2seq", model, (torch.randn(B, T, 32), torch.randn(B, T - 2, 32)),
                forward=_star)


class MHABlock(nn.Module):
    """nn.MultiheadAttention used directly (as torchvision's ViT does), then an FFN."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.fc = nn.Linear(32, 64)
        self.out = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 32)
        h = x + self.attn(x, x, x, need_weights=False)[0]
        return h + self.out(torch.relu(self.fc(h)))


def mha() -> Case:
    torch.manual_seed(0)
    return Case("mha", _ready(MHABlock()), torch.randn(B, T, 32))


# --------------------------------------------------------------------------- HuggingFace


def bert() -> Case:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(BertModel(cfg))
    batch = {"input_ids": _ids(100), "attention_mask": torch.ones(B, T, dtype=torch.long)}
    return Case("bert", model, batch, {"B": B, "T": T, "C": 32, "H": 2, "F": 64, "L": 2})


def gpt2() -> Case:
    """GPT-2 with its LM head (tied to the token embedding); vocab 100 is not fp8-able."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(GPT2LMHeadModel(cfg))
    batch = {"input_ids": _ids(100)}
    return Case("gpt2", model, batch, {"B": B, "T": T, "C": 32, "H": 2, "L": 2, "V": 100})


def llama() -> Case:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(LlamaModel(cfg))
    batch = {"input_ids": _ids(64)}
    dims = {"B": B, "T": T, "C": 32, "H": 2, "KV": 1, "F": 64, "L": 2}
    return Case("llama", model, batch, dims)


def t5() -> Case:
    from transformers import T5Config, T5Model

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, use_cache=False, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(T5Model(cfg))
    batch = {"input_ids": _ids(64), "decoder_input_ids": _ids(64, seed=1)}
    return Case("t5", model, batch, {"B": B, "T": T, "C": 32, "H": 2, "D": 16, "F": 64})


def vit() -> Case:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(ViTModel(cfg, add_pooling_layer=False))
    pixels = torch.randn(B, 3, 16, 16)
    # 16 patches of 4x4 plus the [CLS] token
    return Case("vit", model, {"pixel_values": pixels}, {"B": B, "P": 16, "T": 17, "C": 32})


def whisper() -> Case:
    """Whisper: a conv front end over mel frames, then encoder-decoder attention."""
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(
        vocab_size=64, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16,
        use_cache=False, pad_token_id=0, decoder_start_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(WhisperModel(cfg))
    # 2 * max_source_positions mel frames: the second conv has stride 2
    batch = {"input_features": torch.randn(B, 16, 16), "decoder_input_ids": _ids(64)}
    return Case("whisper", model, batch)


PLAIN = {"mlp": mlp, "branchy": branchy, "shared": shared, "cnn": cnn}
NN_TRANSFORMERS = {"nn_encoder": nn_encoder, "nn_seq2seq": nn_seq2seq, "mha": mha}
HF = {"bert": bert, "gpt2": gpt2, "llama": llama, "t5": t5, "vit": vit, "whisper": whisper}
ALL = {**PLAIN, **NN_TRANSFORMERS, **HF}


Runnable = tuple[str, nn.Module, Callable[[nn.Module, Any], Any], Any]


def runnable(names: tuple[str, ...]) -> list[Runnable]:
    """(name, model, forward, batch) of each named case, the forward autoprec's default
    where the case gives none (keyword batches called with ``**``)."""
    out = []
    for name in names:
        case = ALL[name]()
        fwd = case.forward or (lambda m, b: m(**b) if isinstance(b, dict) else m(b))
        out.append((name, case.model, fwd, case.batch))
    return out
