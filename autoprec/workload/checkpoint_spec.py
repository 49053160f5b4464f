"""A checkpoint folder (``autoprec.stream``) as a ``ModelSpec``: what ``autoprec tune DIR`` and
``autoprec.tune("DIR")`` load (``workload.loading``'s contract, filled from the folder).

``build_model`` opens the folder streamed (``streamed.open_streamed``: blocks load as they
run); calibration and held-out data are real text (``data``: the standard library's
docstrings, or ``data=`` a text file / strings), ``batches`` batches of ``rows`` x
``seq_len`` tokens each; the forward is ``model(input_ids=...)`` and the error is on the
logits (DESIGN's default relative L2).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from autoprec.stream import data as textdata
from autoprec.stream.checkpoint import Checkpoint, is_checkpoint_dir
from autoprec.stream.streamed import open_streamed
from autoprec.workload.loading import ModelSpec, load_model_file

#: Default calibration: a few short sequences keep an 8 B tune's forwards short on a CPU.
BATCHES, ROWS, SEQ_LEN = 1, 1, 64


def checkpoint_spec(folder: str | Path, *, data: str | Path | Sequence[str] | None = None,
                    batches: int = BATCHES, rows: int = ROWS, seq_len: int = SEQ_LEN,
                    name: str | None = None, masters: bool = False,
                    device: str | torch.device | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a checkpoint folder (module doc); ModelFileError (exit 2) for a
    folder that is not one. ``masters``: hold the weights in fp32, as a trainer's master
    weights initialised from the stored ones (a training plan runs autocast over them).
    ``device``: where the model runs (default: the GPU where there is one, else the host);
    the batches are put there."""
    folder = Path(folder)
    ckpt = Checkpoint(folder)  # the folder checked now, one line when it is not one
    dev = torch.device(device if device is not None
                       else "cuda" if torch.cuda.is_available() else "cpu")
    vocab = int(getattr(ckpt.config(), "vocab_size", 0) or 256)

    def calibration() -> list[dict[str, Any]]:
        texts = textdata.read_texts(data, textdata.CALIBRATION_MODULES)
        return _on(dev, textdata.token_batches(texts, folder, vocab, batches, rows, seq_len))

    def held_out() -> list[dict[str, Any]]:
        if data is not None:  # the user's text: its next tokens after the calibration's
            texts = textdata.read_texts(data, textdata.CALIBRATION_MODULES)
            both = textdata.token_batches(texts, folder, vocab, 2 * batches, rows, seq_len)
            return _on(dev, both[batches:])
        return _on(dev, textdata.token_batches(
            textdata.read_texts(None, textdata.EVAL_MODULES), folder, vocab, batches, rows,
            seq_len))

    label = name or re.sub(r"[^A-Za-z0-9._-]", "_", folder.resolve().name).lstrip(".") or "model"
    return ModelSpec(path=None, name=label[:100], build_model=lambda: open_streamed(
                         folder, torch.float32 if masters else None, dev),
                     calibration_data=calibration, eval_data=held_out)


def _on(device: torch.device, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


def load_model(path: str | Path, *, masters: bool = False) -> ModelSpec:
    """What every command loads: a checkpoint folder (a folder with ``config.json``),
    streamed, or a model.py (``loading.load_model_file``). ``masters``: a training plan
    will run on it: a checkpoint's weights are held in fp32 (``checkpoint_spec``); a
    model.py builds what it builds."""
    if is_checkpoint_dir(path):
        return checkpoint_spec(path, masters=masters)
    return load_model_file(path)


__all__ = ["checkpoint_spec", "load_model"]
