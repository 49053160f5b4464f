"""A policy on a streamed model (``autoprec.stream``): installed block by block.

The model's blocks live on ``meta`` until they run, and a plan's deploy form casts and
quantises weights when it is installed, so the policy cannot be installed on the whole
model at once. ``apply_streamed`` validates it once against the whole model (paths,
fingerprint: they are structure), then lets the streamed model run each forward on a
*shell* per block (``StreamedModel.lowered``): the block loaded, the policy restricted to
the modules the shell holds (``restrict``: rules on or inside the blocks not loaded are
dropped; the fingerprint was checked already) installed with ``apply_policy``, the block
run, the policy removed and the block put back on ``meta``. Given how it is applied
(``applied_as``: the target and backend), plans that differ only from a block on compute
the blocks before it alike: the streamed model replays them (``StreamedModel.replaying``). ``audit_streamed`` audits
each shell the same way on one forward and joins the reports' errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from autoprec.apply.apply import ApplyOptions
from autoprec.errors import PolicyWarning
from autoprec.plan.compile import compile_plan
from autoprec.policy.schema import Policy


def restrict(policy: Policy, absent: frozenset[str]) -> Policy:
    """``policy`` without the rules (locked paths, reasons) on or inside ``absent`` paths,
    and without the fingerprint (a shell is not the model; the caller checked it)."""
    def kept(path: str) -> bool:
        return not any(path == a or path.startswith(a + ".") for a in absent)

    model = {k: v for k, v in policy.model.items() if k != "fingerprint"}
    return dataclasses.replace(
        policy, layers={p: v for p, v in policy.layers.items() if kept(p)},
        locked=[p for p in policy.locked if kept(p)],
        reasons={p: v for p, v in policy.reasons.items() if kept(p)}, model=model)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The restricted policies carry no fingerprint: their 'no fingerprint' warning is
    not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        yield


def _whole(model: torch.nn.Module, policy: Policy, force: bool) -> ApplyOptions:
    """The policy checked against the whole model, and its whole plan for every shell."""
    policy.validate(model, force=force)
    return ApplyOptions(whole_plan=compile_plan(policy, model))


def first_rule_block(stream: Any, policy: Policy) -> int:
    """The first block a rule of ``policy`` is on or inside (the number of blocks when
    none is; 0 when a rule is on a module that runs before the blocks or holds them)."""
    first = len(stream.blocks)
    for path in [*policy.layers, *policy.locked]:
        i = stream.block_of(path)
        if i is not None:
            first = min(first, i)
        elif not any(path == a or path.startswith(a + ".") for a in stream.after_blocks):
            return 0
    return first


def replay_kind(policy: Policy, applied_as: Hashable) -> Hashable:
    """What plans computing their first blocks alike share: how they are applied and the
    policy without its rules (form, default, options)."""
    base = dataclasses.replace(policy, layers={}, locked=[], reasons={}, model={}, metrics={},
                               provenance={})
    return (applied_as, json.dumps(base.to_dict(), sort_keys=True, default=str))


def apply_streamed(model: torch.nn.Module, policy: Policy, apply: Callable[..., Any], *,
                   force: bool = False, applied_as: Hashable | None = None
                   ) -> contextlib.AbstractContextManager[Any]:
    """While open, every forward of the streamed ``model`` runs under ``policy``;
    ``apply(root, policy, options)`` installs one restricted policy and returns its handle (the
    caller's ``apply_policy`` with its target and backend, named by ``applied_as``: given,
    the blocks before the policy's first rule are replayed from an earlier plan's forward)."""
    stream = model.autoprec_stream  # type: ignore[union-attr]
    opts = _whole(model, policy, force)

    def lower(root: torch.nn.Module, absent: frozenset[str], call: Callable[[], Any]) -> Any:
        with _quiet():
            handle = apply(root, restrict(policy, absent), opts)
        try:
            return call()
        finally:
            handle.remove()

    if applied_as is None:
        return stream.lowered(lower)
    return stream.lowered(lower, replay_kind(policy, applied_as), first_rule_block(stream, policy))


def audit_streamed(model: torch.nn.Module, policy: Policy, run: Callable[[], Any],
                   audit: Callable[..., Any], *, force: bool = False) -> Any:
    """The audit of ``policy`` on the streamed ``model``: ``audit(root, restricted, call, options)``
    (the caller's ``audit_policy``) on every shell of one forward (``run()``); the first
    shell's report, with every shell's errors and layers."""
    stream = model.autoprec_stream  # type: ignore[union-attr]
    opts = _whole(model, policy, force)
    reports: list[Any] = []

    def lower(root: torch.nn.Module, absent: frozenset[str], call: Callable[[], Any]) -> Any:
        with _quiet():
            rep = audit(root, restrict(policy, absent), call, opts)
        reports.append(rep)
        return rep.result

    with stream.lowered(lower):
        result = run()
    first = reports[0]
    rows = {r.layer: r for r in first.rows}
    for rep in reports[1:]:
        first.errors.extend(e for e in rep.errors if e not in first.errors)
        first.layers.update(rep.layers)
        for r in rep.rows:  # a layer's row from the shell it ran in
            if r.layer not in rows or rows[r.layer].computed == "-":
                rows[r.layer] = r
    # "did not run" holds only where no shell ran the module; other warnings from any
    first.warnings = [w for w in dict.fromkeys(w for rep in reports for w in rep.warnings)
                      if "did not run" not in w or all(w in rep.warnings for rep in reports)]
    for w in first.warnings:
        warnings.warn(w, PolicyWarning, stacklevel=2)
    first.rows = list(rows.values())
    first.result = result
    return first


__all__ = ["apply_streamed", "audit_streamed", "first_rule_block", "replay_kind", "restrict"]
