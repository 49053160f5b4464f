"""After ``transformers``' ``from_pretrained``: put a checkpoint's fp32 islands back.

transformers loads every unquantised weight of a checkpoint in one dtype (config.json's
``dtype``, or the ``dtype=`` asked for); only a model class's own ``_keep_in_fp32_modules``
stays fp32, and a checkpoint cannot name more. ``save_pretrained`` stores each island in
its own dtype and lists it under config.json's ``autoprec.islands``; ``keep_islands``
reads those tensors back from the safetensors files and runs each island as HF runs a
``_keep_in_fp32_modules`` layer (T5's ``wo``): its input cast up to its weights' dtype,
its output cast back to the input's dtype.
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import InputError


def islands_of(checkpoint: str | Path) -> dict[str, str]:
    """``{module path: dtype}`` of the islands ``save_pretrained`` recorded in config.json."""
    cfg = Path(checkpoint) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{cfg}: cannot read the checkpoint's config ({err})") from None
    return dict((data.get("autoprec") or {}).get("islands") or {})


def keep_islands(model: torch.nn.Module, checkpoint: str | Path) -> list[str]:
    """Restore the islands of ``checkpoint`` on ``model`` (loaded from it by transformers):
    their stored tensors put back in their dtype and their forward wrapped (module doc).
    Returns the module paths restored."""
    from safetensors import safe_open

    islands = islands_of(checkpoint)
    if not islands:
        return []
    mods = dict(model.named_modules())
    wanted: dict[str, tuple[str, str]] = {}
    for path in islands:
        if path not in mods:
            raise InputError(f"{checkpoint}: island {path!r} is not a module of the loaded "
                             f"{type(model).__name__}")
        for name in list(mods[path]._parameters) + list(mods[path]._buffers):
            wanted[f"{path}.{name}"] = (path, name)
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key in wanted:
                    path, name = wanted[key]
                    mod = mods[path]
                    t = st.get_tensor(key).to(_device(mod))
                    if name in mod._parameters:
                        mod._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
                    else:
                        mod._buffers[name] = t
    for path in islands:
        _wrap(mods[path])
    return list(islands)


def _device(mod: torch.nn.Module) -> torch.device:
    for t in mod.parameters(recurse=False):
        return t.device
    return torch.device("cpu")


def _wrap(mod: torch.nn.Module) -> None:
    inner = mod.forward
    if getattr(getattr(inner, "__func__", inner), "_autoprec_island", False):
        return

    # a bound method, as loaders that wrap forwards expect (compressed-tensors reads
    # ``module.forward.__func__``)
    @functools.wraps(inner)
    def forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        w = getattr(self, "weight", None)
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and w is not None):
            return inner(x, *args, **kwargs)
        out = inner(x.to(w.dtype), *args, **kwargs)
        return out.to(x.dtype) if isinstance(out, torch.Tensor) else out

    forward._autoprec_island = True  # type: ignore[attr-defined]
    mod.forward = types.MethodType(forward, mod)


__all__ = ["islands_of", "keep_islands"]
