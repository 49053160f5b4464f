"""A HF checkpoint folder opened lazily: the model skeleton on the meta device, weights read
one module at a time from the safetensors shards.

A folder holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file), as
``save_pretrained`` writes them. ``Checkpoint.skeleton()`` builds the model from the config
under ``accelerate.init_empty_weights()`` (parameters on ``meta``: no memory; buffers such as
the rotary ``inv_freq`` are computed from the config on the CPU, as ``from_pretrained``
does), ``load(module, prefix)`` reads that module's tensors with ``safetensors.safe_open``
(each a memory map of one shard: only the bytes read become resident) as new Parameters
in the modules; ``offload(module)`` puts them back on ``meta``. Each swap is reported to
``swapped(old, new)`` (an op recorder that knows parameters by object follows them). A parameter whose dtype was changed while it was on ``meta`` (a deploy-form plan
stores a layer in another precision) is loaded in that dtype, so a plan applied to the
skeleton holds exactly what it would hold applied to the loaded model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.errors import ModelFileError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: safetensors' dtype names -> bytes per element (the header says the dtype of every tensor).
_ST_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_checkpoint_dir(path: str | Path) -> bool:
    """A folder with a ``config.json``: what ``autoprec tune DIR`` takes as a checkpoint."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def _header(file: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (8-byte little-endian length, then JSON)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100 << 20:
            raise ModelFileError(f"{file}: not a safetensors file (header length {n})")
        return json.loads(f.read(n))


#: safetensors dtypes a float skeleton converts on load
_FLOATING = frozenset({"F64", "F32", "F16", "BF16"})


class Checkpoint:
    """The folder, its config and where each tensor lies (see the module doc)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.folder = Path(folder)
        #: where loaded weights are put: the host, or the GPU a tune runs on (the shards are
        #: read straight onto it by safetensors)
        self.device = torch.device(device)
        #: the dtype the weights are held in once loaded (None: as the config names them);
        #: fp32 for a training plan's masters
        self.load_dtype = dtype
        if not is_checkpoint_dir(self.folder):
            raise ModelFileError(f"{self.folder}: not a checkpoint folder (no {CONFIG})")
        index = self.folder / INDEX
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ModelFileError(f"{index}: no weight_map ({err})") from None
            self.weight_map: dict[str, str] = dict(wmap)
        elif (self.folder / SINGLE).is_file():
            self.weight_map = {k: SINGLE for k in _header(self.folder / SINGLE)
                               if k != "__metadata__"}
        else:
            raise ModelFileError(f"{self.folder}: no {SINGLE} and no {INDEX}: autoprec reads "
                                 "safetensors checkpoints (save_pretrained writes them)")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.folder / shard).is_file():
                raise ModelFileError(f"{self.folder}: {INDEX} names shard {shard!r}, which "
                                     "is missing")
        self._headers: dict[str, dict[str, Any]] = {}

    # -- facts from the files, no weights read ----------------------------------------
    def config(self) -> Any:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(str(self.folder))
        except (ValueError, OSError, KeyError) as err:
            raise ModelFileError(f"{self.folder / CONFIG}: {err}".splitlines()[0]) from None

    def header(self, shard: str) -> dict[str, Any]:
        if shard not in self._headers:
            self._headers[shard] = _header(self.folder / shard)
        return self._headers[shard]

    def tensor_bytes(self, name: str, held: bool = False) -> int:
        """Bytes of one stored tensor, from its shard's header; ``held``: once loaded (a
        floating tensor in ``load_dtype`` when one is set: fp32 masters take 4 bytes)."""
        info = self.header(self.weight_map[name])[name]
        n = _ST_BYTES.get(info["dtype"], 4)
        if held and self.load_dtype is not None and info["dtype"] in _FLOATING:
            n = torch.empty((), dtype=self.load_dtype).element_size()
        for d in info["shape"]:
            n *= int(d)
        return n

    def bytes_under(self, prefix: str, held: bool = False) -> int:
        """Bytes of the tensors whose names start with ``prefix.``: stored, or ``held``
        once loaded (``tensor_bytes``)."""
        return sum(self.tensor_bytes(k, held) for k in self.weight_map
                   if k.startswith(prefix + ".") or not prefix)

    def fingerprint(self) -> str:
        """``sha256:…`` of the index and every shard's header, size and mtime: the weights'
        identity without reading them (a rewritten shard has a new mtime)."""
        h = hashlib.sha256()
        for shard in sorted(set(self.weight_map.values())):
            st = os.stat(self.folder / shard)
            h.update(f"{shard}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            h.update(json.dumps(self.header(shard), sort_keys=True).encode())
        return "sha256:" + h.hexdigest()

    def dtype(self) -> torch.dtype:
        """The dtype the config names (``dtype`` / ``torch_dtype``), else the one most
        stored bytes are in."""
        cfg = json.loads((self.folder / CONFIG).read_text())
        named = cfg.get("dtype") or cfg.get("torch_dtype")
        if named in _DTYPES:
            return _DTYPES[named]
        by: dict[str, int] = {}
        for k, shard in self.weight_map.items():
            d = self.header(shard)[k]["dtype"]
            by[d] = by.get(d, 0) + self.tensor_bytes(k)
        top = max(by, key=by.__getitem__) if by else "F32"
        return {"BF16": torch.bfloat16, "F16": torch.float16}.get(top, torch.float32)

    # -- the model ----------------------------------------------------------------------
    def skeleton(self) -> nn.Module:
        """The causal LM built from the config with every parameter on ``meta``, in eval
        mode, without a KV cache (its outputs are the logits alone)."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        config = self.config()
        config.use_cache = False
        dtype = self.load_dtype or self.dtype()
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # the parameters' dtypes on meta, as stored
        try:
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except (ValueError, KeyError) as err:
            raise ModelFileError(f"{self.folder / CONFIG}: transformers cannot build a "
                                 f"causal LM from it: {err}".splitlines()[0]) from None
        finally:
            torch.set_default_dtype(old)
        # buffers (rotary inv_freq) are built in fp32 by the model's own code: keep them so
        for name, buf in model.named_buffers():
            if buf.is_floating_point() and buf.dtype != torch.float32 and "inv_freq" in name:
                buf.data = buf.data.float()
        return model.eval()

    def _tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        by_shard: dict[str, list[str]] = {}
        for n in names:
            by_shard.setdefault(self.weight_map[n], []).append(n)
        for shard, keys in by_shard.items():
            with safe_open(str(self.folder / shard), framework="pt",
                           device=str(self.device)) as f:
                for k in keys:
                    yield k, f.get_tensor(k)

    def load(self, module: nn.Module, prefix: str,
             swapped: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> int:
        """Read ``module``'s parameters (path ``prefix`` in the model) from the shards, each
        in the dtype it has now (see the module doc); returns the bytes loaded. A parameter
        the checkpoint lacks (a tied ``lm_head.weight``) is left as it is."""
        local = {n: t for n, t in module.named_parameters(remove_duplicate=False)}
        names = {f"{prefix}.{n}" if prefix else n: n for n in local}
        present = [k for k in names if k in self.weight_map]
        total = 0
        for key, value in self._tensors(present):
            rel = names[key]
            cur = local[rel]
            if tuple(value.shape) != tuple(cur.shape):
                raise ModelFileError(f"{self.folder}: tensor {key!r} has shape "
                                     f"{tuple(value.shape)}, the config's model "
                                     f"{tuple(cur.shape)}")
            swap_in(module, rel, value, swapped)
            total += value.numel() * cur.element_size()
        return total


def offload(module: nn.Module,
            swapped: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
    """Every parameter of ``module`` back on ``meta`` (same shape and dtype): its memory is
    freed once nothing else holds it."""
    for name, p in list(module.named_parameters()):
        if p.device.type != "meta":
            swap_in(module, name, torch.empty_like(p, device="meta"), swapped)


def swap_in(module: nn.Module, name: str, value: torch.Tensor,
            swapped: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
    """``module``'s parameter ``name`` (a dotted path inside it) becomes a new Parameter
    holding ``value`` in the old one's dtype; ``swapped(old, new)`` is told."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    old = owner._parameters[leaf]
    assert old is not None
    new = nn.Parameter(value.to(old.dtype), requires_grad=old.requires_grad)
    owner._parameters[leaf] = new
    if swapped is not None:
        swapped(old, new)


__all__ = ["Checkpoint", "is_checkpoint_dir", "offload", "swap_in"]
