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
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from autoprec.cost import CostModel
from autoprec.formats.precisions import PRECISIONS, REGIONS
from autoprec.plan.schedule import replay, same_as


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _inside(path: str, container: str) -> bool:
    return container == "" or path.startswith(container + ".")


def _without(layers: Mapping[str, str], paths: Iterable[str]) -> dict[str, str]:
    drop = set(paths)
    return {k: v for k, v in layers.items() if k not in drop}


class _Checker:
    """Does a (default, rules) run the same plan as the explicit one? Many at once.

    One RuleSet over every path a rewrite can use (the rules and their ancestors); a
    candidate whose module-level plan (regions, precisions, wrappers) equals the explicit
    one's runs the same plan without a replay; the others are replayed together, one row
    each (``plan.schedule.same_as``: the signature test, vectorised).
    """

    def __init__(self, cost: CostModel, default: str, layers: Mapping[str, str],
                 extra: Iterable[str] = ()) -> None:
        self.cost = cost
        known = set(cost.tree.paths)
        paths = dict.fromkeys([*layers, *(p for p in extra if p in known)])
        for path in layers:
            parts = path.split(".")
            for i in range(len(parts)):
                anc = ".".join(parts[:i])
                if anc in known:
                    paths.setdefault(anc)
        self.rules = cost.rules(list(paths))
        self.want = self.rules.codes_of(default, layers)
        region, prec, wrapped = self.rules.encode(self.want[None, :])
        self._mods = (region, prec, wrapped)
        self.calls = 0
        self.replays = 0

    def same_many(self, cands: Sequence[tuple[str, Mapping[str, str]]]) -> list[bool]:
        if not cands:
            return []
        self.calls += len(cands)
        rows = np.stack([self.rules.codes_of(d, lay) for d, lay in cands])
        mods = self.rules.encode(rows)
        ident = np.ones(len(rows), dtype=bool)
        for got, want in zip(mods, self._mods, strict=True):
            ident &= (got == want).all(axis=1)
        out = ident.copy()
        todo = np.flatnonzero(~ident)
        if todo.size:
            self.replays += 1
            both = [np.concatenate([want, got[todo]]) for got, want in zip(mods, self._mods,
                                                                           strict=True)]
            sch = replay(self.cost.trace, *both, self.cost.device_type, self.cost.form)
            out[todo] = same_as(sch, 0)[1:]
        return [bool(x) for x in out]

    def same(self, default: str, layers: Mapping[str, str]) -> bool:
        return self.same_many([(default, layers)])[0]

    def precision_of(self, paths: Iterable[str]) -> dict[str, str]:
        """The precision each of ``paths`` (rule paths) computes in under the explicit plan."""
        index = self.cost.tree.index()
        prec = self._mods[1][0]
        return {p: PRECISIONS[int(prec[index[self.cost.tree.aliases.get(p, p)]])]
                for p in paths}


def _drop_redundant(check: _Checker, default: str, layers: dict[str, str],
                    among: Sequence[str] | None = None) -> dict[str, str]:
    """Remove each rule (deepest first) whose removal keeps the plan.

    Rules of one depth are tested together (none covers another, so each one's removal
    changes only its own subtree); the joint removal is checked once more, and tested
    rule by rule should it not hold.
    """
    out = dict(layers)
    paths = list(among if among is not None else out)
    for depth in sorted({_depth(p) for p in paths}, reverse=True):
        level = [p for p in paths if _depth(p) == depth and p in out]
        ok = check.same_many([(default, _without(out, [p])) for p in level])
        drop = [p for p, y in zip(level, ok, strict=True) if y]
        if not drop:
            continue
        joint = _without(out, drop)
        if len(drop) == 1 or check.same(default, joint):
            out = joint
            continue
        for p in drop:
            trial = _without(out, [p])
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


def _inner(layers: Mapping[str, str], c: str) -> dict[str, str]:
    return {k: v for k, v in layers.items() if k != c and _inside(k, c)}


def _try_container(check: _Checker, default: str, out: dict[str, str], c: str,
                   precs: Sequence[str]) -> dict[str, str]:
    """One container rule at each of ``precs`` in turn, kept when the plan is the same and
    the rules are fewer (rule by rule: the fallback of the batched step)."""
    inner = _inner(out, c)
    for prec in precs:
        trial = {**out, c: prec}
        if not check.same(default, trial):
            continue
        trial = _drop_redundant(check, default, trial, among=list(inner))
        if len(trial) < len(out):
            return trial
    return out


def _compact_with(check: _Checker, cost: CostModel, default: str,
                  layers: Mapping[str, str]) -> dict[str, str]:
    """Containers deepest first; those of one depth (disjoint subtrees) tried together."""
    out = _drop_redundant(check, default, dict(layers))
    conts = _containers(cost, out)
    for depth in sorted({_depth(c) for c in conts}, reverse=True):
        pending = {}
        for c in conts:
            inner = _inner(out, c)
            if _depth(c) == depth and len(inner) >= 2:
                pending[c] = [p for p, _n in Counter(inner.values()).most_common(2)]
        for attempt in range(2):
            cands = [(c, ps[attempt]) for c, ps in pending.items() if len(ps) > attempt]
            ok = check.same_many([(default, {**out, c: prec}) for c, prec in cands])
            won = {c: prec for (c, prec), y in zip(cands, ok, strict=True) if y}
            if not won:
                continue
            trial = {**out, **won}
            inner_all = [k for k in out if any(k != c and _inside(k, c) for c in won)]
            trial = _drop_redundant(check, default, trial, among=inner_all)
            # keep a container's rule only where it shortened its subtree
            kept = [c for c in won
                    if len(_inner(trial, c)) + 1 < len(_inner(out, c))]
            new = {k: v for k, v in out.items() if not any(_inside(k, c) for c in kept)}
            new.update({k: v for k, v in trial.items()
                        if any(k == c or _inside(k, c) for c in kept)})
            if kept and (len(kept) == 1 and len(won) == 1 or check.same(default, new)):
                out = new
            elif kept:  # the subtrees interact after all: one container at a time
                for c in kept:
                    out = _try_container(check, default, out, c, [won[c]])
            for c in kept:
                pending.pop(c)
    return out


def compact(cost: CostModel, default: str, layers: Mapping[str, str],
            defaults: Sequence[str] = ()) -> tuple[str, dict[str, str]]:
    """The shortest (default, rules) that runs the same plan as (default, layers).

    ``defaults``: other defaults to try (a plan whose rules all say bf16 may read better as
    ``default: bf16``, when the model's own code runs the same either way).
    """
    # Every GEMM leaf is a rule path: under another default a leaf without a rule would
    # change precision, so the rewrite starts from each leaf's precision made explicit
    # (`default: fp32` + a tf32 rule on every Linear but the head reads `default: tf32` +
    # `head: fp32`; without the head's path it could not be said, and 16 rules stayed).
    leaves = [n.path for n in cost.graph.gemm_nodes]
    check = _Checker(cost, default, layers, extra=leaves)
    best = (default, _compact_with(check, cost, default, layers))
    explicit = {**check.precision_of(p for p in leaves if p in check.rules.rule_paths),
                **layers}
    for other in defaults:
        if other == default:
            continue
        start = dict(explicit)
        if "" not in start and not check.same(other, start):
            start[""] = default  # the root's own code must keep the region it was measured in
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


def differences(cost: CostModel, a: tuple[str, Mapping[str, str]],
                b: tuple[str, Mapping[str, str]]) -> list[tuple[str, str, str]]:
    """Where two (default, rules) plans put a module in another precision: ``(path,
    precision under a, under b)`` for the outermost such modules (a child that differs as
    its parent does is not listed again), in the model's order; ``""`` is the model's own
    code (the default region)."""
    rules = cost.rules(list(dict.fromkeys([*a[1], *b[1]])))
    rows = np.stack([rules.codes_of(*a), rules.codes_of(*b)])
    _region, prec, _wrapped = rules.encode(rows)
    paths = cost.tree.paths
    listed: dict[str, tuple[int, int]] = {}
    for j in np.flatnonzero(prec[0] != prec[1]):
        path, pair = paths[j], (int(prec[0, j]), int(prec[1, j]))
        parent = path
        while parent:
            parent = parent.rpartition(".")[0]
            if listed.get(parent) == pair:
                break
        else:
            listed[path] = pair
            continue
    return [(p, PRECISIONS[x], PRECISIONS[y]) for p, (x, y) in listed.items()]


__all__ = ["compact", "differences"]
