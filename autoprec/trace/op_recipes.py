"""An op's recipe: how to run one recorded op alone (``Op.recipe``).

``measure.op_times`` times each op of a recorded forward on this machine by rebuilding it from
its recipe: the function (``F.linear``, ``aten.add.Tensor``) and its arguments, tensors as
their value id, shape, strides and dtype; dtypes, devices, memory formats and layouts tagged.
An argument that cannot be rebuilt (a Python object, a generator...) leaves the op without
a recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_F = torch.nn.functional
#: ``torch.nn.functional``'s functions as imported (the recorder points two of its globals
#: elsewhere while a composite such as ``F.multi_head_attention_forward`` runs).
_F_FUNCS = {name: f for name, f in vars(_F).items() if callable(f)}


class _NoRecipe(Exception):
    """An argument a recipe cannot rebuild (a Python object, a generator...)."""


def _spec(obj: Any, vid: Callable[[torch.Tensor], int]) -> Any:
    """A JSON-able picture of an op argument: tensors as {"t": value id, "shape", "stride",
    "dt"}; dtypes, devices and memory formats tagged; containers as lists."""
    if isinstance(obj, torch.Tensor):
        return {"t": vid(obj), "shape": list(obj.shape), "stride": list(obj.stride()),
                "dt": str(obj.dtype).replace("torch.", "")}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_spec(x, vid) for x in obj]
    if isinstance(obj, dict):
        return {"kw": {str(k): _spec(v, vid) for k, v in obj.items()}}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).replace("torch.", "")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, torch.memory_format):
        return {"mf": str(obj).replace("torch.", "")}
    if isinstance(obj, torch.layout):
        return {"layout": str(obj).replace("torch.", "")}
    raise _NoRecipe(type(obj).__name__)


def _func_name(func: Any) -> str | None:
    """``F.linear`` for a torch.nn.functional function, ``aten.add.Tensor`` for an aten op."""
    if isinstance(func, torch._ops.OpOverload):
        return str(func)
    name = getattr(func, "__name__", None)
    if name is not None and _F_FUNCS.get(name) is func:
        return f"F.{name}"
    return None


def op_recipe(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              vid: Callable[[torch.Tensor], int]) -> dict[str, Any] | None:
    """``{"f": function name, "a": args, "k": kwargs}`` of ``func(*args, **kwargs)``,
    tensors named by ``vid``; None where the function or an argument cannot be rebuilt."""
    name = _func_name(func)
    if name is None:
        return None
    try:
        return {"f": name, "a": _spec(list(args), vid), "k": _spec(dict(kwargs), vid)["kw"]}
    except _NoRecipe:
        return None


__all__ = ["op_recipe"]
