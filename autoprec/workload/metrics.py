"""The error of a model's outputs against the fp32 reference (docs/overview.md, "Default error").

Default: relative L2 over every floating tensor of the outputs, over the whole set:
``sqrt(sum ||y - y_ref||^2) / sqrt(sum ||y_ref||^2)``; any non-finite value makes it inf.
With a user ``metric``, the error is the drop ``metric(fp32) - metric(policy)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def iter_floats(obj: Any) -> Iterator[torch.Tensor]:
    """Every floating tensor inside tensors, tuples, lists, dicts, dataclasses and
    HuggingFace ModelOutput objects; other members (a KV-cache object, ints) are skipped."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
        return
    if isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "values")):
        for v in obj.values():  # ModelOutput is an OrderedDict of its non-None fields
            yield from iter_floats(v)
        return
    if isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_floats(v)
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_floats(getattr(obj, f.name))


def detach_floats(obj: Any) -> list[torch.Tensor]:
    """The floating tensors of ``obj`` as detached fp32 CPU copies (references to keep)."""
    return [t.detach().float().cpu() for t in iter_floats(obj)]


def relative_error(sq_err: float, sq_ref: float, nonfinite: int = 0) -> float:
    """``sqrt(sq_err / sq_ref)``, the one rule for every relative L2 error autoprec reports
    (outputs, a layer's local error, its gradients): any non-finite value -> inf; nothing
    to compare against (``sq_ref`` 0) -> 0 when nothing differs, else inf."""
    if nonfinite:
        return math.inf
    if sq_ref == 0.0:
        return 0.0 if sq_err == 0.0 else math.inf
    return math.sqrt(sq_err / sq_ref)


@dataclasses.dataclass
class ErrorAccumulator:
    """Accumulates the relative L2 error batch by batch."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    nonfinite: int = 0
    tensors: int = 0

    def add(self, outputs: Any, reference: Sequence[torch.Tensor]) -> None:
        got = detach_floats(outputs) if not _is_tensor_list(outputs) else list(outputs)
        if len(got) != len(reference):
            raise ValueError(
                f"outputs hold {len(got)} floating tensors, the reference {len(reference)}"
            )
        for y, r in zip(got, reference):
            y = y.detach().float().cpu()
            bad = int((~torch.isfinite(y)).sum())
            self.nonfinite += bad
            self.tensors += 1
            if bad:
                continue
            self.sq_err += float(((y - r) ** 2).sum())
            self.sq_ref += float((r**2).sum())

    @property
    def error(self) -> float:
        return relative_error(self.sq_err, self.sq_ref, self.nonfinite)


def _is_tensor_list(obj: Any) -> bool:
    return isinstance(obj, list) and all(isinstance(t, torch.Tensor) for t in obj)


def mean_metric(
    metric: Callable[[Any, Any], float], outputs: Sequence[Any], batches: Sequence[Any]
) -> float:
    """The user metric averaged over batches (weighted by the batch's leading size)."""
    total, weight = 0.0, 0.0
    for out, batch in zip(outputs, batches):
        w = float(batch_size_of(batch) or 1)
        value = float(metric(out, batch))
        if not math.isfinite(value):
            return -math.inf
        total += w * value
        weight += w
    return total / weight if weight else 0.0


def batch_size_of(batch: Any) -> int | None:
    """Leading dimension of the first tensor in a batch (sequences/images, not tokens)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, dict) or hasattr(batch, "values"):
        for v in batch.values():
            n = batch_size_of(v)
            if n is not None:
                return n
        return None
    if isinstance(batch, (tuple, list)):
        for v in batch:
            n = batch_size_of(v)
            if n is not None:
                return n
    return None
