"""Write a plan with the fewest rules: a default, container rules where a block shares a
precision, and only the exceptions left.

The search works with an explicit rule on every GEMM layer (one plan per key, no
inheritance surprises). The policy a person reviews should say the same thing briefly.
Every rewrite here is accepted only when the recorded forward replays identically under
it (``plan.schedule.signature``: the same kernels, dtypes and casts), so the compact
policy and the explicit one compile to the same plan — what was measured and priced is
what the written file runs.

Steps: drop rules that change nothing (a child at what it would inherit); then, deepest
container first, try one rule on the container at its children's most common precision
and drop what that makes redundant; then try the other defaults. Keep the shortest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from autoprec.cost import CostModel
from autoprec.plan.schedule import signature
from autoprec.precisions import REGIONS


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _inside(path: str, container: str) -> bool:
    return container == "" or path.startswith(container + ".")


class _Checker:
    def __init__(self, cost: CostModel, default: str, layers: Mapping[str, str]) -> None:
        self.cost = cost
        self.want = signature(cost.schedule(dict(layers), default))
        self.calls = 0

    def same(self, default: str, layers: Mapping[str, str]) -> bool:
        self.calls += 1
        return signature(self.cost.schedule(dict(layers), default)) == self.want


def _drop_redundant(check: _Checker, default: str, layers: dict[str, str],
                    among: Sequence[str] | None = None) -> dict[str, str]:
    """Remove each rule (deepest first) whose removal keeps the plan."""
    out = dict(layers)
    for path in sorted(among if among is not None else list(out), key=_depth, reverse=True):
        if path not in out:
            continue
        trial = {k: v for k, v in out.items() if k != path}
        if check.same(default, trial):
            out = trial
    return out


def _containers(cost: CostModel, layers: Mapping[str, str]) -> list[str]:
    """Module paths holding at least two ruled layers, deepest first."""
    counts: Counter[str] = Counter()
    for path in layers:
        parts = path.split(".")
        for i in range(len(parts)):
            counts[".".join(parts[:i])] += 1
    known = set(cost.tree.paths)
    return sorted((c for c, n in counts.items() if n >= 2 and c in known and c not in layers),
                  key=_depth, reverse=True)


def _compact_with(check: _Checker, cost: CostModel, default: str,
                  layers: Mapping[str, str]) -> dict[str, str]:
    out = _drop_redundant(check, default, dict(layers))
    for c in _containers(cost, out):
        inner = {k: v for k, v in out.items() if _inside(k, c)}
        if len(inner) < 2:
            continue
        for prec, _n in Counter(inner.values()).most_common(2):
            trial = {**out, c: prec}
            if not check.same(default, trial):
                continue
            trial = _drop_redundant(check, default, trial, among=list(inner))
            if len(trial) < len(out):
                out = trial
                break
    return out


def compact(cost: CostModel, default: str, layers: Mapping[str, str],
            defaults: Sequence[str] = ()) -> tuple[str, dict[str, str]]:
    """The shortest (default, rules) that runs the same plan as (default, layers).

    ``defaults``: other defaults to try (a plan whose rules all say bf16 may read better as
    ``default: bf16``, when the model's own code runs the same either way).
    """
    check = _Checker(cost, default, layers)
    best = (default, _compact_with(check, cost, default, layers))
    for other in defaults:
        if other == default:
            continue
        start = dict(layers)
        if "" not in start:  # the root's own code must keep the region it was measured in
            start[""] = default
        trial = _compact_with(check, cost, other, start)
        if len(trial) < len(best[1]) and check.same(other, trial):
            best = (other, trial)
    root = best[1].get("")
    if root is not None and root in REGIONS and root != best[0]:
        # a rule on the root covers every module: read it as the default when that runs the
        # same plan (`default: bf16` + `'': fp16` -> `default: fp16`)
        rest = {k: v for k, v in best[1].items() if k != ""}
        if check.same(root, rest):
            best = (root, _compact_with(check, cost, root, rest))
    return best


__all__ = ["compact"]
