"""The deploy form's consumer input rules: where they are installed, and for how long.

A module with weights (Linear, conv, MHA) or a norm inside a region reads an input of
another dtype by its own rule (``lower.stored.consumer_forward``): a GEMM casts it to its
weights' dtype, a norm computes in fp32. Where every region of a plan stores one dtype
(a uniform plan: ``default: fp16``, no rules) nothing the plan makes arrives in another
dtype — the root casts the inputs — so the rules are not installed and the fast path runs
the module's own forward.

The guard's re-run (``apply.guard``) breaks that: a layer raised to its fallback
precision gives bf16 (or fp32) where the plan gives fp16, and the next Linear would meet
a bf16 input with fp16 weights ("mat1 and mat2 must have the same dtype"). ``RerunCasts``
installs the rules for the re-run only, on the modules that do not have them, and takes
them off again: the fast path of a guarded uniform plan keeps its cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from autoprec.formats.precisions import PRECISIONS, STORAGE_DTYPES
from autoprec.lower.stored import consumer_forward
from autoprec.plan.compile import ExecutionPlan

_MISSING = object()


def consumers(plan: ExecutionPlan, by_path: Mapping[str, torch.nn.Module],
              done: set[int]) -> list[tuple[torch.nn.Module, str]]:
    """``(module, region precision)`` of every module of the plan that has a consumer
    rule (``lower.stored.consumer_kind``) and no wrapper of its own (``done``: ids of the
    wrapped modules), in the plan's order; a module shared by two paths once."""
    out: list[tuple[torch.nn.Module, str]] = []
    seen = set(done)
    for j, p in enumerate(plan.tree.paths):
        mod = by_path.get(p)
        if mod is None or id(mod) in seen:
            continue
        prec = PRECISIONS[int(plan.region[j])]
        if consumer_forward(mod, prec) is not None:
            out.append((mod, prec))
            seen.add(id(mod))
    return out


def one_storage_dtype(plan: ExecutionPlan) -> bool:
    """Whether every region of ``plan`` stores one dtype (no consumer rule is needed)."""
    return len({STORAGE_DTYPES[PRECISIONS[int(r)]] for r in plan.region}) == 1


def consumer_wrappers(pairs: Sequence[tuple[torch.nn.Module, str]]
                      ) -> list[tuple[torch.nn.Module, Callable[..., Any]]]:
    """The rules as ``(module, forward)`` wrappers, installed with the plan's own."""
    out = []
    for mod, prec in pairs:
        fwd = consumer_forward(mod, prec)
        if fwd is not None:
            out.append((mod, fwd))
    return out


class RerunCasts:
    """The consumer rules a uniform plan leaves out, for the guard's re-runs only.

    ``installed()`` puts each rule on its module around whatever forward the module has
    then (the guard's leaf check included: a raised layer still runs its shadow), and
    puts the module's forward back on exit, also when the re-run raises."""

    def __init__(self, pairs: Sequence[tuple[torch.nn.Module, str]]) -> None:
        self.pairs = list(pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved: list[tuple[torch.nn.Module, Any]] = []
        try:
            for mod, prec in self.pairs:
                fwd = consumer_forward(mod, prec)  # around the forward it has now
                if fwd is None:
                    continue
                saved.append((mod, mod.__dict__.get("forward", _MISSING)))
                mod.forward = fwd  # type: ignore[method-assign]
            yield
        finally:
            for mod, old in reversed(saved):
                if old is _MISSING:
                    mod.__dict__.pop("forward", None)
                else:
                    mod.forward = old  # type: ignore[method-assign]


__all__ = ["RerunCasts", "consumer_wrappers", "consumers", "one_storage_dtype"]
