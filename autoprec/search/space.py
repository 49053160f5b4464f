"""The search space: the default region plus one precision per GEMM layer (or group).

A *plan key* is a tuple of precision codes (index into PRECISIONS): the default region
first (fp32/tf32/bf16/fp16: where the model's own code runs), then one code per variable
in execution order. A key is turned into a policy with an explicit rule on every GEMM
layer (``rules``), so it compiles to exactly one plan: a child never silently inherits a
container's precision. ``search.compaction`` writes the same plan with the fewest rules.

Choices are narrowed by hard facts before any trial runs: the precisions asked for, what
the target device can run (its profile), what the layer can take (the graph: fp8 only on
16-aligned Linear-like leaves) and what the probes proved impossible (a layer whose
output overflows fp16 never gets fp16). Every removed choice keeps its reason; the policy
file reports them for the layers that stay higher. Locked layers stay fp32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoprec.formats.precisions import PRECISIONS, rank
from autoprec.formats.precisions import REGIONS as _REGIONS

#: Above this many GEMM layers, repeated blocks share a variable (``layers.*.attn.q``).
DEFAULT_MAX_VARIABLES = 1024
#: Optuna parameter name of the default region.
REGION = "default"
#: Precisions a region (the model's own code) can take: the GEMM formats are backends only.
REGIONS = _REGIONS

Key = tuple[int, ...]


@dataclass
class Variable:
    """One decision: the precision of ``layers`` (set together)."""

    name: str  # Optuna parameter name: a layer path, a group pattern with '*', or REGION
    layers: list[str]
    choices: list[str]  # most precise first; always starts with fp32
    excluded: dict[str, str] = field(default_factory=dict)  # precision -> why not


@dataclass
class SearchSpace:
    """The region variable, the layer variables, and layers fixed by ``locked`` (fp32)."""

    variables: list[Variable]
    region: Variable = field(default_factory=lambda: Variable(REGION, [""], ["fp32"]))
    locked: dict[str, str] = field(default_factory=dict)  # layer -> fixed precision

    @property
    def layers(self) -> list[str]:
        return [lay for v in self.variables for lay in v.layers]

    @property
    def all_variables(self) -> list[Variable]:
        """The region first, then the layer variables (the order of a key)."""
        return [self.region, *self.variables]

    @property
    def rule_paths(self) -> list[str]:
        """Every path a key's policy has a rule on (layers, then locked)."""
        return [*self.layers, *(p for p in self.locked if p not in set(self.layers))]

    def key(self, params: Mapping[str, str]) -> Key:
        """The plan key of an Optuna params dict (missing variables: fp32)."""
        return tuple(PRECISIONS.index(params.get(v.name, "fp32")) for v in self.all_variables)

    def params(self, key: Key) -> dict[str, str]:
        return {v.name: PRECISIONS[c] for v, c in zip(self.all_variables, key, strict=True)}

    def rules(self, key: Key) -> tuple[str, dict[str, str]]:
        """(default, {path: precision}) with a rule on every GEMM layer and locked path."""
        default = PRECISIONS[key[0]]
        layers = {lay: PRECISIONS[c] for v, c in zip(self.variables, key[1:], strict=True)
                  for lay in v.layers}
        layers.update({p: "fp32" for p in self.locked})
        return default, layers

    def codes(self, keys: np.ndarray) -> np.ndarray:
        """Rule code rows (T, 1 + len(rule_paths)) of keys (T, 1 + len(variables))."""
        keys = np.atleast_2d(np.asarray(keys, dtype=np.intp))
        cols = [keys[:, 0]]
        for j, v in enumerate(self.variables):
            cols.extend([keys[:, j + 1]] * len(v.layers))
        fixed = PRECISIONS.index("fp32")
        cols.extend([np.full(len(keys), fixed, np.intp)] * (len(self.rule_paths)
                                                            - len(self.layers)))
        return np.stack(cols, axis=1)

    def uniform(self, precision: str) -> Key:
        """The default and every variable at ``precision`` where allowed, else at its lowest
        allowed precision more precise than ``precision`` (fp32 at worst)."""
        out = []
        for v in self.all_variables:
            ok = [c for c in v.choices if rank(c) <= rank(precision)]
            out.append(PRECISIONS.index(ok[-1] if ok else v.choices[0]))
        return tuple(out)

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
        for v in self.all_variables:
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
    regions: Sequence[str] | None = None,
    max_variables: int = DEFAULT_MAX_VARIABLES,
    fused: Iterable[Sequence[str]] = (),
) -> SearchSpace:
    """Build the space for GEMM ``layers`` (execution order).

    ``allowed[layer]``: precisions the layer may take (graph, device, probes combined);
    ``excluded[layer]``: precision -> reason for those it may not. ``precisions``: the
    user's list (fp32 is always a choice). ``regions``: the default region's choices
    (default: the user's precisions that are regions). Locked layers (or children of a
    locked path) stay fp32.
    """
    wanted = [p for p in PRECISIONS if p in set(precisions) | {"fp32"}]
    locked = list(locked)
    fixed: dict[str, str] = {}
    per_layer: list[tuple[list[str], list[str], dict[str, str]]] = []
    for layer in layers:
        if any(layer == lk or layer.startswith(lk + ".") for lk in locked):
            fixed[layer] = "fp32"
            continue
        why_not = dict(excluded.get(layer, {}))
        ok = set(allowed.get(layer, ()))
        choices = [p for p in wanted if (p in ok and p not in why_not) or p == "fp32"]
        per_layer.append(([layer], choices, {p: why_not[p] for p in wanted if p in why_not}))
    for lk in locked:
        fixed.setdefault(lk, "fp32")

    per_layer = tie_fused(per_layer, fused)
    if len(per_layer) <= max_variables:
        variables = [Variable(_name(lays), lays, ch, ex) for lays, ch, ex in per_layer]
    else:
        groups: dict[str, Variable] = {}
        for lays, ch, ex in per_layer:
            key = group_key(_name(lays))
            g = groups.get(key)
            if g is None:
                groups[key] = Variable(key, list(lays), list(ch), dict(ex))
            else:  # a group may only take what all its members may take
                g.layers.extend(lays)
                g.choices = [c for c in g.choices if c in ch]
                g.excluded.update(ex)
        variables = list(groups.values())
    region_choices = [p for p in (regions if regions is not None else wanted)
                      if p in REGIONS and p in wanted] or ["fp32"]
    if "fp32" not in region_choices:
        region_choices.insert(0, "fp32")
    region = Variable(REGION, [""], [p for p in REGIONS if p in region_choices])
    return SearchSpace(variables, region, fixed)


def _name(layers: Sequence[str]) -> str:
    """A variable's name: its layer's path, or a fused group's as ``parent.{a,b,c}``."""
    if len(layers) == 1:
        return layers[0]
    parents = {lay.rpartition(".")[0] for lay in layers}
    if len(parents) == 1:
        return f"{parents.pop()}.{{{','.join(lay.rpartition('.')[2] for lay in layers)}}}"
    return "{" + ",".join(layers) + "}"


def tie_fused(per_layer: list[tuple[list[str], list[str], dict[str, str]]],
              fused: Iterable[Sequence[str]]
              ) -> list[tuple[list[str], list[str], dict[str, str]]]:
    """``(layers, choices, excluded)`` rows with each fused group's rows made one, at its
    first member's place: the choices all members allow, and every member's exclusions,
    each naming its member (``fp16: a.up_proj (one fused group): overflow, …``)."""
    group_of = {lay: i for i, g in enumerate(fused) for lay in g}
    rows: list[tuple[list[str], list[str], dict[str, str]]] = []
    members: dict[int, list[tuple[str, list[str], dict[str, str]]]] = {}
    at: dict[int, int] = {}
    for lays, ch, ex in per_layer:
        g = group_of.get(lays[0])
        if g is None:
            rows.append((lays, ch, ex))
            continue
        if g not in at:
            at[g] = len(rows)
            rows.append(([], [], {}))  # filled below
        members.setdefault(g, []).append((lays[0], ch, ex))
    for g, ms in members.items():
        if len(ms) == 1:
            rows[at[g]] = ([ms[0][0]], ms[0][1], ms[0][2])
            continue
        why: dict[str, str] = {}
        for lay, _, ex in ms:
            for p, w in ex.items():
                text = w[len(p) + 2:] if w.startswith(f"{p}: ") else w
                why[p] = (f"{why[p]}; " if p in why else f"{p}: ") + \
                    f"{lay} (one fused group): {text}"
        rows[at[g]] = ([lay for lay, _, _ in ms],
                       [c for c in ms[0][1] if all(c in ch for _, ch, _ in ms)], why)
    return rows


__all__ = ["DEFAULT_MAX_VARIABLES", "Key", "REGION", "REGIONS", "SearchSpace", "Variable",
           "build_space", "group_key", "tie_fused"]
