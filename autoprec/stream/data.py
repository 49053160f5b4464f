"""Real text for a checkpoint's calibration: the docstrings of standard-library modules.

A checkpoint folder brings no data, and random token ids are not text: a model's
activations on them (and so its sensitivity to a precision) are not what it sees in use.
The default is the text the MiniLM example already uses (``examples/minilm_mlm``): the
docstrings of a fixed list of standard-library modules, tokenised with the folder's own
tokenizer when it has one (``tokenizer.json`` / ``tokenizer_config.json``). Without one,
each byte of the UTF-8 text becomes token id ``byte % vocab_size`` (``bytes_to_ids``): real
text's statistics, not the model's vocabulary — said in ``describe``. A user's own text
(``--data FILE``, or a list of strings) takes the docstrings' place.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import InputError

#: Calibration and held-out text come from disjoint module lists (as examples/minilm_mlm).
CALIBRATION_MODULES = ("json", "argparse", "collections", "functools", "pathlib", "textwrap")
EVAL_MODULES = ("itertools", "string", "shutil", "fractions")


def docstrings(modules: Sequence[str]) -> list[str]:
    """The docstrings of each module and of its public classes and functions, in order."""
    texts = []
    for name in modules:
        mod = importlib.import_module(name)
        if mod.__doc__:
            texts.append(inspect.cleandoc(mod.__doc__))
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__doc__:
                texts.append(inspect.cleandoc(obj.__doc__))
    return texts


def has_tokenizer(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json",
                                                "tokenizer.model"))


def bytes_to_ids(text: str, vocab_size: int) -> list[int]:
    """Each UTF-8 byte of ``text`` as token id ``byte % vocab_size`` (no tokenizer)."""
    return [b % vocab_size for b in text.encode("utf-8")]


def token_batches(texts: Sequence[str], folder: Path, vocab_size: int, batches: int,
                  rows: int, seq_len: int) -> list[dict[str, Any]]:
    """``batches`` batches ``{"input_ids": (rows, seq_len)}`` of the texts' tokens, packed
    in order (a text's end runs into the next)."""
    need = batches * rows * seq_len
    ids: list[int] = []
    tok = None
    if has_tokenizer(folder):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
    for text in texts:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"] if tok is not None
                   else bytes_to_ids(text + "\n", vocab_size))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise InputError(f"the calibration text holds {len(ids)} tokens, {need} are needed "
                         f"({batches} batches of {rows} x {seq_len})")
    full = torch.tensor(ids[:need]).view(batches, rows, seq_len)  # (B, R, T)
    return [{"input_ids": full[i].clone()} for i in range(batches)]


def read_texts(data: str | Path | Sequence[str] | None, modules: Sequence[str]) -> list[str]:
    """The user's text (a file, or strings) or, with None, the docstrings of ``modules``."""
    if data is None:
        return docstrings(modules)
    if isinstance(data, (str, Path)):
        path = Path(data)
        try:
            return [path.read_text(encoding="utf-8")]
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"--data {path}: cannot read it as UTF-8 text: {err}") from None
    return [str(t) for t in data]


def describe(folder: Path, data: Any) -> str:
    """One line for people: where the calibration tokens come from."""
    text = "the docstrings of " + ", ".join(CALIBRATION_MODULES) if data is None \
        else f"{data}" if isinstance(data, (str, Path)) else "the given texts"
    how = ("tokenised with the checkpoint's tokenizer" if has_tokenizer(folder) else
           "as UTF-8 bytes mod the vocabulary (the folder has no tokenizer)")
    return f"{text}, {how}"


__all__ = ["CALIBRATION_MODULES", "EVAL_MODULES", "bytes_to_ids", "describe", "docstrings",
           "read_texts", "token_batches"]
