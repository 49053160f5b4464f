"""The largest storage the ops run under a mode allocate (not views of their inputs)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NewBytes(TorchDispatchMode):
    """Records the largest tensor storage an op allocated (not a view of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.sizes: list[int] = []  # every new storage's bytes, in order

    @property
    def second(self) -> int:
        """The second largest new storage (0 when fewer than two)."""
        top = sorted(self.sizes, reverse=True)
        return top[1] if len(top) > 1 else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append(t.untyped_storage().nbytes())
                self.largest = max(self.largest, self.sizes[-1])
        return out
