"""One decoder between a trial, its plan and the policy's rules; what "the same plan" is.

    trial params   Optuna's {variable name: precision} (``space.all_variables``)
      ↕ key        a tuple of precision codes, the default region first (search/space.py)
      ↓ explicit   (default, a rule on every GEMM layer and locked path): what the search
                   applies, measures and prices — one plan per key, no inheritance
      ↓ compact    (default, the fewest rules that run the same plan; search/compaction.py):
                   what the policy file says; recorded on a feasible trial
                   (``user_attrs["policy"]``) so that a study can be exported without the
                   model

Every stage that turns a trial or a key into rules or a policy asks a ``TrialDecoder``
(the search's own, ``tune.Search.decoder``); none calls ``space.rules`` or
``compact.compact`` itself.

The same plan — two notions with two jobs, defined here; every other use derives from one:

1. **The same name: what apply installs.** ``policy.build.plan_id(default, layers, form)``: the form,
   the default and the sorted rules (a plan with no 16-bit tensor anywhere — fp32 or tf32,
   no rules — runs alike in both forms). The trial key is this name inside one search
   space: ``explicit(key)`` gives every GEMM layer and locked path a rule, so a key names
   its explicit rules one to one; a trial's params are the key in Optuna's spelling
   (``space.key``). Used for identity: a trial is not run twice (the driver's claim and
   cache, ``select.dedupe``), and rows beside the baselines are timed once per plan_id
   (``evaluation.rows.Row.key``).
2. **The same run: what the kernels do.** ``plan.schedule.signature`` (vectorised:
   ``plan.schedule.same_as``): the same kernels on the same dtypes, the same casts and
   quantisation passes in the recorded forward. Coarser than 1: many names, one run (two
   default regions no op runs in once every GEMM layer is set; a compact rule set and the
   explicit one). Used where a name is traded for another: the walk measures no key whose
   run (``Planner.signature``, cached per key) and priced time equal those of a key
   measured or being measured, and ``compact`` accepts only rewrites of the same run (what
   was measured and priced is what the written file runs).

Why not one: 2 needs the recorded forward and the cost model (``autoprec export`` and the
study's storage have neither; a trial's identity must be exact and free), and it leaves out
what apply installs around the kernels (the host time of every call through a wrapper,
``Schedule.wrapper_calls``), which a measurement tells apart — so rows are timed once only
when their names are one. And 1 alone would let the walk spend a measurement on a second
name of a run it has measured, and give ``compact`` nothing to check its rewrites against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoprec.policy import Policy
from autoprec.policy.build import policy_for
from autoprec.search import compaction
from autoprec.search.space import Key, SearchSpace

#: (default, {module path: precision})
Rules = tuple[str, dict[str, str]]


class TrialDecoder:
    """Trial params ↔ key ↔ rules of one search space.

    ``cost``: the cost model the compact rules are checked on (``compact.compact``); None
    (``autoprec export``: no model) decodes a trial to the rules recorded on it, else to
    its explicit rules (the same plan, written longer).
    """

    def __init__(self, space: SearchSpace, cost: Any = None) -> None:
        self.space = space
        self.cost = cost
        self._compact: dict[Key, Rules] = {}

    def key(self, params: Mapping[str, str]) -> Key:
        """The plan key of a trial's params (a missing variable: fp32)."""
        return self.space.key(params)

    def params(self, key: Key) -> dict[str, str]:
        """The trial params of a plan key."""
        return self.space.params(key)

    def explicit(self, key: Key) -> Rules:
        """A rule on every GEMM layer and locked path: what the search runs."""
        return self.space.rules(key)

    def compact(self, key: Key) -> Rules:
        """The fewest rules that run the same plan as ``explicit(key)`` (cached)."""
        hit = self._compact.get(key)
        if hit is None:
            if self.cost is None:
                raise ValueError("TrialDecoder.compact needs the cost model (cost=...)")
            default, layers = self.explicit(key)
            hit = compaction.compact(self.cost, default, layers,
                                  defaults=self.space.region.choices)
            self._compact[key] = hit
        return hit[0], dict(hit[1])

    def rules(self, cand: Any) -> Rules:
        """The rules to write for a study candidate (``select.Candidate``): those recorded
        on it (compacted when it was measured, or a baseline's own), else its compact
        rules, else (no cost model) its explicit ones."""
        if cand.policy:
            return cand.policy["default"], dict(cand.policy["layers"])
        key = self.key(cand.params)
        return self.compact(key) if self.cost is not None else self.explicit(key)

    def policy(self, key: Key, *, fingerprint: str | None = None, target: str | None = None,
               form: str = "train") -> Policy:
        """The policy the search applies for ``key`` (explicit rules)."""
        return policy_for(*self.explicit(key), fingerprint, target, form)


__all__ = ["Rules", "TrialDecoder"]
