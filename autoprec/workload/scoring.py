"""Score a model (with or without a policy applied) against its fp32 reference.

The reference is computed once per data set and reused: every trial of a search compares
against the same fp32 outputs. ``score`` is "error" in the budget's units: the relative L2
error by default, or the metric drop ``metric(fp32) - metric(now)`` with a user metric.

The reference is where model.py's forward and metric are judged (ModelFileError, exit 2,
naming ``forward()`` / ``metric()`` and the batch): a forward with no floating output
measures nothing (relative error 0 over zero tensors would pass every policy), a
non-finite fp32 output leaves nothing to compare with (its cause is named: a parameter,
the input batch, or the first module whose output is non-finite), and a metric must be a
finite number on the fp32 model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.errors import ModelFileError
from autoprec.fused import fused_paths_off
from autoprec.io.fileio import brief
from autoprec.lower.wide16 import scoring_gemms
from autoprec.workload.loading import ModelSpec
from autoprec.workload.metrics import (
    ErrorAccumulator,
    batch_size_of,
    detach_floats,
    iter_floats,
    mean_metric,
)


@dataclass
class Reference:
    """fp32 outputs (floating tensors, CPU) and metric of one data set."""

    outputs: list[list[torch.Tensor]]
    metric: float | None
    batches: int


@dataclass
class Score:
    """How far a lowered model is from the reference on one data set."""

    error: float  # relative L2 of the outputs (inf if any non-finite)
    metric: float | None  # user metric, when model.py has one
    metric_drop: float | None  # reference metric - metric
    nonfinite: int

    @property
    def value(self) -> float:
        """The number a budget binds: metric drop when there is a metric, else error."""
        if self.metric_drop is not None:
            return self.metric_drop if self.nonfinite == 0 else math.inf
        return self.error


def _outputs(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any], what: str,
             lowered: bool = False) -> list[Any]:
    """Forward every batch. A failure of the fp32 model is the user's (ModelFileError, exit
    2); once the fp32 reference ran, a failure under a policy is not: it propagates as is
    (a search trial records it as failed, with the reason)."""
    outs = []
    # 16-bit GEMMs this CPU has no kernel for are scored as a GPU computes them (lower/wide16)
    with torch.no_grad(), fused_paths_off(), scoring_gemms():
        for i, batch in enumerate(batches):
            outs.append(spec.forward(model, batch) if lowered else spec.run(model, batch, i, what))
    return outs


def reference(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any],
              what: str = "", need_outputs: bool | None = None) -> Reference:
    """Run the fp32 model once over ``batches`` and keep its outputs and metric.

    ``need_outputs``: the budget is on the outputs (relative L2), so forward() must return
    floating tensors (default: when model.py has no metric). ModelFileError (exit 2) for a
    forward or metric the reference cannot use (see the module docs).
    """
    outs = _outputs(spec, model, batches, what)
    floats = [detach_floats(o) for o in outs]
    if need_outputs is None:
        need_outputs = spec.metric is None
    if need_outputs and not any(floats):
        raise ModelFileError(
            f"{spec.where}: forward() returned no floating-point tensor (batch 0{_of(what)} "
            f"gave {_output_kind(outs[0])}); the error is measured on "
            "floating outputs: return them (e.g. the logits, not an argmax), or define "
            "metric(outputs, batch) and tune with --max-drop")
    for i, tensors in enumerate(floats):
        for k, t in enumerate(tensors):
            if not bool(torch.isfinite(t).all()):
                raise ModelFileError(_nonfinite_reference(spec, model, batches, i, k, t, what))
    value = _reference_metric(spec, outs, batches, what) if spec.metric is not None else None
    return Reference(floats, value, len(batches))


def _output_kind(out: Any) -> str:
    """'an int64 tensor of shape (32,)', 'a dict of str, int', 'NoneType None'."""
    if isinstance(out, torch.Tensor):
        dtype = str(out.dtype).replace("torch.", "")
        article = "an" if dtype.startswith("int") else "a"
        return f"{article} {dtype} tensor of shape {tuple(out.shape)}"
    if isinstance(out, dict):
        kinds = sorted({type(v).__name__ for v in out.values()})
        return f"a dict of {', '.join(kinds[:5]) or 'nothing'}"
    if isinstance(out, (tuple, list)):
        kinds = sorted({type(v).__name__ for v in out})
        return f"a {type(out).__name__} of {', '.join(kinds[:5]) or 'nothing'}"
    return f"{type(out).__name__} {brief(out)}"


def _of(what: str) -> str:
    return f" {what}" if what else ""


def _reference_metric(spec: ModelSpec, outs: Sequence[Any], batches: Sequence[Any],
                      what: str) -> float:
    """The batch-weighted mean of metric() on the fp32 model; each value must be finite."""
    metric = spec.metric
    total, weight = 0.0, 0.0
    for i, (out, batch) in enumerate(zip(outs, batches)):
        value = float(metric(out, batch))  # type: ignore[misc]  # one number, or ModelFileError (loading)
        if not math.isfinite(value):
            raise ModelFileError(
                f"{spec.where}: metric() returned {value} for the fp32 model on batch {i}"
                f"{_of(what)}; the fp32 metric is what a policy is measured against: it "
                "must be a finite number")
        w = float(batch_size_of(batch) or 1)
        total, weight = total + w * value, weight + w
    return total / weight if weight else 0.0


def _nonfinite_reference(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any],
                         index: int, k: int, t: torch.Tensor, what: str) -> str:
    """'the fp32 reference itself is non-finite: …' with where it comes from."""
    kind = "nan" if bool(torch.isnan(t).any()) else "inf"
    count = int((~torch.isfinite(t)).sum())
    head = (f"{spec.where}: the fp32 reference itself is non-finite: output tensor {k} of "
            f"batch {index}{_of(what)} holds {kind} ({count} of {t.numel()} values)")
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            return (f"{head}; parameter {name!r} of build_model()'s model holds "
                    "non-finite values")
    for t_in in iter_floats(batches[index]):
        if not bool(torch.isfinite(t_in).all()):
            return f"{head}; the input batch {index} itself holds non-finite values"
    module = first_nonfinite_module(spec, model, batches[index])
    where = f" first in the output of module {module!r}" if module else ""
    return (f"{head}: the fp32 model overflows{where} (its parameters and inputs are "
            "finite); nothing to compare lower precisions against")


@contextmanager
def nonfinite_watch(model: torch.nn.Module) -> Iterator[list[str]]:
    """While open, the list it yields gets the path of the first module (in execution
    order) whose output holds inf/nan."""
    found: list[str] = []

    def hook(name: str) -> Any:
        def fn(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if not found and any(not bool(torch.isfinite(t).all()) for t in iter_floats(out)):
                found.append(name)
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def first_nonfinite_module(spec: ModelSpec, model: torch.nn.Module, batch: Any) -> str | None:
    """The path of the first module (in execution order) whose output holds inf/nan."""
    with nonfinite_watch(model) as found:
        try:
            with torch.no_grad(), fused_paths_off():
                spec.forward(model, batch)
        except Exception:  # the diagnosis is best effort; the error is reported anyway
            return None
    return found[0] if found else None


def score(spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any], ref: Reference,
          what: str = "") -> Score:
    """Run ``model`` (as it is now, e.g. with a policy applied) and compare to ``ref``."""
    outs = _outputs(spec, model, batches, what, lowered=True)
    acc = ErrorAccumulator()
    for out, r in zip(outs, ref.outputs):
        acc.add(out, r)
    metric = drop = None
    if spec.metric is not None and ref.metric is not None:
        metric = mean_metric(spec.metric, outs, batches)
        drop = ref.metric - metric if math.isfinite(metric) else math.inf
    return Score(acc.error, metric, drop, acc.nonfinite)


def batch_tensors(batch: Any, depth: int = 0) -> list[torch.Tensor]:
    """Copies of the tensors in a batch (tensor / tuple / list / dict), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch.detach().clone()]
    if depth > 4:
        return []
    items = (batch.values() if isinstance(batch, dict)
             else batch if isinstance(batch, (tuple, list)) else ())
    return [t for v in items for t in batch_tensors(v, depth + 1)]


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype
        and (torch.equal(x, y) if not x.is_floating_point()
             else bool(torch.isclose(x, y, rtol=0, atol=0, equal_nan=True).all()))
        for x, y in zip(a, b))
