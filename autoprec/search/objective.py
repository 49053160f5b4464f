"""Scoring one assignment: error on the calibration data and estimated time on the target.

Error comes from really running the model with the assignment applied (the same apply path
users get), against the fp32 reference computed once. Time comes from the cost model at
the deployment batch size. Cheap first: an assignment is scored on a subset of the
calibration batches, and only one that is not hopeless there runs on the rest.
Assignments already scored (this process, or any finished trial of a shared study) are
not run again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel
from autoprec.evaluate import Reference, reference, score
from autoprec.loading import ModelSpec
from autoprec.policy import Policy
from autoprec.search.evaluation import Evaluation
from autoprec.search.space import SearchSpace
from autoprec.trace.graph import fingerprint

#: A subset error this many times the budget is hopeless: the full set is not run.
SCREEN_FACTOR = 3.0


def policy_for(assignment: Mapping[str, str], default: str = "fp32",
               fingerprint: str | None = None) -> Policy:
    """A minimal policy that sets each listed layer (no target metadata)."""
    model = {"fingerprint": fingerprint} if fingerprint else {}
    return Policy(default=default, layers={k: v for k, v in assignment.items() if v != default},
                  model=model)


class Evaluator:
    """Scores Optuna params dicts; counts how many model evaluations it really ran."""

    def __init__(
        self,
        *,
        spec: ModelSpec,
        model: torch.nn.Module,
        batches: Sequence[Any],
        ref: Reference,
        cost: CostModel,
        space: SearchSpace,
        budget: float,
        min_speedup: float | None = None,
        fp8_backend: str = "emulated",
        screen: bool = True,
    ) -> None:
        self.spec, self.model, self.cost, self.space = spec, model, cost, space
        self.budget, self.min_speedup, self.fp8_backend = budget, min_speedup, fp8_backend
        self.batches, self.ref = list(batches), ref
        # Screening subset: the first quarter of the batches, when there are >= 4.
        n_sub = len(self.batches) // 4 if screen and len(self.batches) >= 4 else 0
        self.sub_batches = self.batches[:n_sub]
        self.sub_ref = Reference(ref.outputs[:n_sub], None, n_sub) if n_sub else None
        if n_sub and spec.metric is not None:
            # a metric drop needs the subset's own fp32 metric
            self.sub_ref = reference(spec, model, self.sub_batches, "(calibration subset)")
        self.fp32_time = cost.estimate({})
        self.fingerprint = fingerprint(model)
        self.cache: dict[tuple[str, ...], Evaluation] = {}
        self.evaluations = 0.0  # full-set equivalents of model evaluation

    def key(self, params: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(params.get(v.name, self.space.default) for v in self.space.variables)

    def remember(self, params: Mapping[str, str], attrs: Mapping[str, Any]) -> None:
        """Prefill the cache from a finished trial's user attributes (shared studies)."""
        if "error" not in attrs or "est_time" not in attrs:
            return
        err = math.inf if attrs.get("nonfinite") else float(attrs["error"])
        self.cache[self.key(params)] = Evaluation(
            err, float(attrs["est_time"]), float(attrs.get("est_speedup", 1.0)),
            bool(attrs.get("feasible", False)), bool(attrs.get("screened", False)), True)

    def timing(self, params: Mapping[str, str]) -> tuple[float, float]:
        t = self.cost.estimate(self.space.assignment(params))
        return t, self.fp32_time / t if t > 0 else 1.0

    def error(self, params: Mapping[str, str], batches: Sequence[Any], ref: Reference,
              what: str) -> float:
        assignment = self.space.assignment(params)
        policy = policy_for(assignment, self.space.default, self.fingerprint)
        with apply_policy(self.model, policy, fp8_backend=self.fp8_backend):
            return score(self.spec, self.model, batches, ref, what).value

    def feasible(self, error: float, speedup: float) -> bool:
        if not error <= self.budget:  # also False for nan
            return False
        return self.min_speedup is None or speedup >= self.min_speedup

    def __call__(self, params: Mapping[str, str]) -> Evaluation:
        key = self.key(params)
        hit = self.cache.get(key)
        if hit is not None:
            return Evaluation(hit.error, hit.est_time, hit.est_speedup, hit.feasible,
                              hit.screened, cached=True)
        est_time, speedup = self.timing(params)
        n = len(self.batches)
        if all(p == self.space.default for p in key):
            ev = Evaluation(0.0, est_time, speedup, self.feasible(0.0, speedup))
            # nothing lowered: the reference itself (checked once in tune for determinism)
        elif self.sub_ref is not None:
            sub_err = self.error(params, self.sub_batches, self.sub_ref, "(screening)")
            self.evaluations += len(self.sub_batches) / n
            if not sub_err <= SCREEN_FACTOR * self.budget:
                ev = Evaluation(sub_err, est_time, speedup, False, screened=True)
            else:
                err = self.error(params, self.batches, self.ref, "(calibration)")
                self.evaluations += 1.0
                ev = Evaluation(err, est_time, speedup, self.feasible(err, speedup))
        else:
            err = self.error(params, self.batches, self.ref, "(calibration)")
            self.evaluations += 1.0
            ev = Evaluation(err, est_time, speedup, self.feasible(err, speedup))
        self.cache[key] = ev
        return ev
