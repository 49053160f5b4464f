"""The model's modules as a policy sees them: their paths (aliases of a shared module
included), which of them are GEMM leaves, the checks of a policy's rules against them
(``check_model``, behind ``Policy.validate``), and the record of one module's resolution.

Precedence (docs/overview.md): a rule covers its module and every child; the most specific path
wins; ``default`` covers what no rule does. A GEMM format (fp8, mxfp8, nvfp4) is not an
autocast region but a module backend, so such a rule only reaches Linear-like *leaves*
eligible for it: every other module it covers takes the nearest enclosing region rule, or
the default. Each module therefore has a *region* (fp32/tf32/bf16/fp16: the numeric
context its own code runs in) and a *precision* (its region, or the format for an
eligible leaf under a format rule). That decision is made in one place, the compiled plan
(``autoprec.plan.compile``: ``compile_plan``, ``resolve``, ``assignment``); this module
holds what it needs from the model and the checks that need no decision.

The schema calls ``check_model`` (``Policy.validate``), so this module does not import the
schema back: what it reads of a policy is the structural type :class:`PolicyRules`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from autoprec.errors import FingerprintMismatch, PolicyError, warn
from autoprec.formats import gemm
from autoprec.formats.precisions import is_gemm_format
from autoprec.fused import not_called_reason
from autoprec.io.paths import normalize_path, unwrap_model
from autoprec.trace.graph import fingerprint


class PolicyRules(Protocol):
    """What the checks here read of a policy (``autoprec.policy.schema.Policy``)."""

    @property
    def source(self) -> str: ...  # names the file in error messages
    @property
    def fingerprint(self) -> str | None: ...
    @property
    def layers(self) -> Mapping[str, str]: ...  # module path -> precision
    @property
    def locked(self) -> Sequence[str]: ...
    @property
    def reasons(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class Resolved:
    """The outcome of the policy for one module path (``ExecutionPlan.resolution()``)."""

    path: str
    precision: str  # what this module's own GEMMs compute in
    region: str  # the numeric context its code runs in (never fp8)
    rule: str | None  # the rule path that decided ``precision``; None: the default

    @property
    def rule_label(self) -> str:
        return "<default>" if self.rule is None else (self.rule or "<root>")


def is_leaf(module: torch.nn.Module) -> bool:
    return next(iter(module.children()), None) is None


def is_gemm_leaf(module: torch.nn.Module) -> bool:
    """A leaf whose forward is a matmul/conv (Linear, Conv*, Bilinear, HF Conv1D: what the
    format decides, ``formats.gemm.is_gemm_module``) and runs (MHA's out_proj does not: its
    GEMM is the attention's)."""
    return is_leaf(module) and gemm.is_gemm_module(module) and not_called_reason(module) is None


def format_eligible(module: torch.nn.Module, precision: str) -> bool:
    """A leaf that can run GEMM format ``precision`` (fp8 / mxfp8 / nvfp4)."""
    return gemm.eligible(module, precision)


def module_table(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module path (aliases of a shared module included) of the unwrapped model."""
    root = unwrap_model(model)
    return {normalize_path(p): m for p, m in root.named_modules(remove_duplicate=False)}


def alias_paths(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: first path}`` for every path of a module registered under several names
    (``self.mid2 = self.mid``): the module is known by its first path (``named_modules()``
    order), and so are the children reached through the alias."""
    root = unwrap_model(model)
    first = {id(m): normalize_path(p) for p, m in root.named_modules()}
    return {normalize_path(p): first[id(m)]
            for p, m in root.named_modules(remove_duplicate=False)
            if normalize_path(p) != first[id(m)]}


def canonical_rules(policy: PolicyRules, aliases: Mapping[str, str]) -> dict[str, str]:
    """The policy's rules with every path written as its module's first path (``aliases``:
    :func:`alias_paths`).

    One module object computes in one precision, so a rule on any of a shared module's
    paths is a rule on the module. Two rules naming one module with different precisions
    are a PolicyError."""
    out: dict[str, str] = {}
    named: dict[str, str] = {}
    for p, prec in policy.layers.items():
        c = aliases.get(p, p)
        if c in out and out[c] != prec:
            a, b = (named[c], p) if named[c] == c else (p, named[c])
            raise PolicyError(
                f"{policy.source}: layers: module {a!r} is also registered as {b!r} (one "
                f"shared module), and the policy gives it {policy.layers[a]} there and "
                f"{policy.layers[b]} here; give both paths the same precision (or name one)")
        out.setdefault(c, prec)
        named.setdefault(c, p)
    return out


def gemm_leaf_paths(model: torch.nn.Module) -> list[str]:
    """Paths of GEMM leaves, each module once (its first path), in registration order."""
    root = unwrap_model(model)
    return [normalize_path(p) for p, m in root.named_modules() if is_gemm_leaf(m)]


def _hint(path: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(path, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(fp: str) -> str:
    return fp[:19] + "…" if len(fp) > 20 else fp


#: The end of the warning for a fingerprint mismatch that ``force`` let through.
FORCED = "; applied anyway (forced)"


def check_model(policy: PolicyRules, model: torch.nn.Module, force: bool = False) -> None:
    """Validate ``policy`` against ``model``; PolicyError names the first problem.

    Order: fingerprint (the most telling when the model changed), unknown paths, a rule
    on a module whose forward never runs, conflicting rules on a shared module, fp8 on
    ineligible leaves. Warnings: no fingerprint, a forced mismatch. Nothing here decides
    which rule covers a module: an fp8 container rule that reaches no eligible leaf is
    the compiled plan's warning (``ExecutionPlan.warn_unreached``, run by apply_policy).
    """
    src = policy.source
    root = unwrap_model(model)
    if policy.fingerprint is None:
        warn(f"{src}: model.fingerprint: missing; the model's structure is not checked "
             "(normal for a hand-written policy)")
    else:
        actual = fingerprint(root)
        if policy.fingerprint != actual:
            msg = (f"{src}: model.fingerprint: {_short(policy.fingerprint)} does not match "
                   f"the model ({_short(actual)}): the policy was written for a model of "
                   "another structure")
            if not force:
                raise FingerprintMismatch(msg + "; re-tune it, or force it (--force)")
            warn(msg + FORCED)

    table = module_table(root)
    for section, paths in (("layers", list(policy.layers)), ("locked", policy.locked),
                           ("reasons", list(policy.reasons))):
        for i, p in enumerate(paths):
            if p not in table:
                key = f"locked[{i}]" if section == "locked" else f"{section}[{p!r}]"
                raise PolicyError(f"{src}: {key}: the model has no module {p!r}"
                                  f"{_hint(p, table)}")

    for p in policy.layers:
        why = not_called_reason(table[p])
        if why is not None:
            raise PolicyError(f"{src}: layers[{p!r}]: a rule here cannot run: {why}")

    canonical_rules(policy, alias_paths(root))  # two rules naming one shared module agree
    for p, prec in policy.layers.items():
        if is_gemm_format(prec) and is_leaf(table[p]):
            why = gemm.ineligible_reason(table[p], prec)
            if why is not None:
                raise PolicyError(f"{src}: layers[{p!r}]: {prec} rule on an ineligible layer: "
                                  f"{why}")


__all__ = ["FORCED", "PolicyRules", "Resolved", "alias_paths", "canonical_rules", "check_model", "format_eligible",
           "gemm_leaf_paths", "is_gemm_leaf", "module_table"]
