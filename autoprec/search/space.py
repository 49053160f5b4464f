"""The search space: one categorical precision per GEMM layer (or per group of layers).

Choices are narrowed by hard facts before any trial runs: the precisions asked for, what
the target device can run (its profile), what the layer can take (the graph: fp8 only on
16-aligned Linear-like layers) and what the probes proved impossible (a layer whose
output overflows fp16 never gets fp16). Every removed choice keeps its reason; the policy
file reports them for the layers that stay higher.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from autoprec.precisions import PRECISIONS, rank

#: Above this many GEMM layers, repeated blocks share a variable (``layers.*.attn.q``).
DEFAULT_MAX_VARIABLES = 64


@dataclass
class Variable:
    """One decision: the precision of ``layers`` (set together)."""

    name: str  # Optuna parameter name: a layer path, or a group pattern with '*'
    layers: list[str]
    choices: list[str]  # most precise first; always starts with fp32
    excluded: dict[str, str] = field(default_factory=dict)  # precision -> why not


@dataclass
class SearchSpace:
    """Variables, plus layers fixed by ``locked`` (they keep ``default``)."""

    variables: list[Variable]
    locked: dict[str, str] = field(default_factory=dict)  # layer -> fixed precision
    default: str = "fp32"

    @property
    def layers(self) -> list[str]:
        return [lay for v in self.variables for lay in v.layers]

    def assignment(self, params: Mapping[str, str]) -> dict[str, str]:
        """Layer path -> precision for an Optuna params dict (missing -> default)."""
        out = dict(self.locked)
        for v in self.variables:
            p = params.get(v.name, self.default)
            for layer in v.layers:
                out[layer] = p
        return out

    def params(self, assignment: Mapping[str, str]) -> dict[str, str]:
        """Optuna params for a layer assignment (a group takes its first layer's value)."""
        out = {}
        for v in self.variables:
            p = assignment.get(v.layers[0], self.default)
            out[v.name] = p if p in v.choices else self.default
        return out

    def uniform(self, precision: str) -> dict[str, str]:
        """Every variable at ``precision`` where allowed, else at its lowest allowed
        precision that is still more precise than ``precision`` (fp32 at worst)."""
        params = {}
        for v in self.variables:
            ok = [c for c in v.choices if rank(c) <= rank(precision)]
            params[v.name] = ok[-1] if ok else v.choices[0]
        return params

    def reasons(self) -> dict[str, str]:
        """Why each layer cannot take some precisions (for the policy's ``reasons``)."""
        out = {}
        for v in self.variables:
            if v.excluded:
                text = "; ".join(f"{why}" if why.startswith(p) else f"{p}: {why}"
                                 for p, why in v.excluded.items())
                for layer in v.layers:
                    out[layer] = text
        return out

    @property
    def size(self) -> float:
        n = 1.0
        for v in self.variables:
            n *= len(v.choices)
        return n


def group_key(path: str) -> str:
    """``encoder.layer.3.attention.q`` -> ``encoder.layer.*.attention.q``."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path)


def build_space(
    layers: Iterable[str],
    allowed: Mapping[str, Iterable[str]],
    excluded: Mapping[str, Mapping[str, str]],
    precisions: Iterable[str],
    *,
    locked: Iterable[str] = (),
    default: str = "fp32",
    max_variables: int = DEFAULT_MAX_VARIABLES,
) -> SearchSpace:
    """Build the space for GEMM ``layers`` (execution order).

    ``allowed[layer]``: precisions the layer may take (graph, device, probes combined);
    ``excluded[layer]``: precision -> reason for those it may not. ``precisions``: the
    user's list. Locked layers (or children of a locked path) keep ``default``.
    """
    wanted = [p for p in PRECISIONS if p in set(precisions) | {default}]
    locked = list(locked)
    fixed: dict[str, str] = {}
    per_layer: list[tuple[str, list[str], dict[str, str]]] = []
    for layer in layers:
        if any(layer == lk or layer.startswith(lk + ".") for lk in locked):
            fixed[layer] = default
            continue
        why_not = dict(excluded.get(layer, {}))
        ok = set(allowed.get(layer, ()))
        choices = [p for p in wanted if (p in ok and p not in why_not) or p == default]
        per_layer.append((layer, choices, {p: why_not[p] for p in wanted if p in why_not}))

    if len(per_layer) <= max_variables:
        variables = [Variable(lay, [lay], ch, ex) for lay, ch, ex in per_layer]
    else:
        groups: dict[str, Variable] = {}
        for lay, ch, ex in per_layer:
            key = group_key(lay)
            g = groups.get(key)
            if g is None:
                groups[key] = Variable(key, [lay], list(ch), dict(ex))
            else:  # a group may only take what all its members may take
                g.layers.append(lay)
                g.choices = [c for c in g.choices if c in ch]
                g.excluded.update(ex)
        variables = list(groups.values())
    return SearchSpace(variables, fixed, default)
