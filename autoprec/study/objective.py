"""Scoring one plan: error on the calibration data, time on the target.

Error comes from really running the model with the plan applied (the same apply path users
get, for the tune's target: on a CPU a CUDA target's autocast op lists are followed),
against the reference computed once (the model as given: its own outputs, fp32 or 16-bit);
time from the cost model's replay of the plan.
Cheap first: a plan is scored on a subset of the calibration batches, and only one that is
not hopeless there runs on the rest. When eval data is separate, a plan within budget on
the calibration data is confirmed on it at once (the budget binds there). Plans already
scored (this process, or any finished trial of a shared study) are not run again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autoprec.evaluation.scoring_context import SCORING_FP8_BACKEND, ScoringContext
from autoprec.policy import Policy
from autoprec.policy.build import policy_for
from autoprec.pricing.target import Target
from autoprec.search.decode import TrialDecoder
from autoprec.search.plan_score import PlanScore
from autoprec.search.planner import PlanSpace
from autoprec.search.space import Key, SearchSpace
from autoprec.workload.loading import ModelSpec
from autoprec.workload.scoring import Reference, reference, score

#: A subset error this many times the budget is hopeless: the full set is not run.
SCREEN_FACTOR = 3.0


def given_policy(reference: Any, fingerprint: str | None = None,
                 target: str | None = None) -> Policy:
    """The model as given (``reference.ModelReference``) as a deploy-form policy."""
    return policy_for(reference.default, reference.rules(), fingerprint, target, "deploy")


class PlanScorer:
    """Scores plan keys; counts how many model evaluations it really ran. What a policy
    is scored and audited on (the model, its data, the targets) is ``context``, built
    once: tune's last step scores its rows through it (``tuning.confirm``)."""

    def __init__(
        self,
        *,
        spec: ModelSpec,
        model: torch.nn.Module,
        batches: Sequence[Any],
        ref: Reference,
        plans: PlanSpace,
        budget: float,
        target: Target,
        min_speedup: float | None = None,
        eval_batches: Sequence[Any] | None = None,
        eval_ref: Reference | None = None,
        screen: bool = True,
        exact: Key | None = None,
        decoder: TrialDecoder | None = None,
    ) -> None:
        self.context = ScoringContext.build(
            spec=spec, model=model, batches=list(batches), ref=ref, target=target,
            eval_batches=list(eval_batches) if eval_batches is not None else None,
            eval_ref=eval_ref)
        ctx = self.context
        self.spec, self.model, self.plans = spec, model, plans
        self.space: SearchSpace = plans.space
        self.decoder = decoder if decoder is not None else TrialDecoder(plans.space, plans.cost)
        self.budget, self.min_speedup = budget, min_speedup
        self.target = target  # the tune's: its name goes into every policy, its form
        self.scoring = ctx.scoring  # the target as the search scores on it
        self.form = ctx.form  # the form every plan of the search runs in
        self.batches, self.ref = ctx.batches, ref
        self.eval_batches, self.eval_ref = ctx.eval_batches, eval_ref
        # Screening subset: the first quarter of the batches, when there are >= 4.
        n_sub = len(self.batches) // 4 if screen and len(self.batches) >= 4 else 0
        self.sub_batches = self.batches[:n_sub]
        self.sub_ref = Reference(ref.outputs[:n_sub], None, n_sub) if n_sub else None
        if n_sub and spec.metric is not None:
            # a metric drop needs the subset's own fp32 metric
            self.sub_ref = reference(spec, model, self.sub_batches, "(calibration subset)")
        self.fp32_time = plans.cost.fp32_time
        # the plan that is the model as given: error 0 without running (an fp32 model's
        # all-fp32 plan; a bf16 model's own layout, ``reference.ModelReference``)
        self.exact = exact if exact is not None else self.space.uniform("fp32")
        self.fingerprint = ctx.fingerprint
        self.cache: dict[Key, PlanScore] = {}
        self.evaluations = 0.0  # full-set equivalents of model evaluation
        # --train-aware: policy -> (trains like fp32, details); run on plans within budget
        self.extra_check: Callable[[Policy], tuple[bool, dict[str, Any]]] | None = None

    def remember(self, key: Key, attrs: Mapping[str, Any]) -> None:
        """Prefill the cache from a finished trial's user attributes (shared studies)."""
        ev = PlanScore.from_attrs(attrs)
        if ev is not None:
            self.cache[key] = ev

    def timing(self, key: Key) -> tuple[float, float]:
        t = self.plans.time(key)
        return t, (self.fp32_time / t if 0 < t < math.inf else 0.0)

    def policy(self, key: Key) -> Policy:
        return self.decoder.policy(key, fingerprint=self.fingerprint, target=self.target.name,
                                   form=self.form)

    def uniform_score(self, precision: str) -> PlanScore | None:
        """The search's own score of ``default: precision`` with no rules, where it
        measured that very plan (None: it did not)."""
        key = self.space.uniform(precision)
        default, layers = self.decoder.explicit(key)
        # rules equal to their region's precision install nothing: the same plan
        if default == precision and set(layers.values()) <= {precision}:
            return self.cache.get(key)
        return None

    def error(self, key: Key, batches: Sequence[Any], ref: Reference, what: str) -> float:
        with self.scoring.apply(self.model, self.policy(key)):
            return score(self.spec, self.model, batches, ref, what).value

    def audit(self, key: Key) -> list[str]:
        """The audit's errors for the plan on one real forward (empty: every rule ran)."""
        return self.audit_policy(self.policy(key))

    def audit_policy(self, policy: Policy) -> list[str]:
        """The audit's errors for ``policy`` (a plan or a baseline) on one real forward."""
        return self.context.audit(policy)

    def within(self, error: float, speedup: float) -> bool:
        if not error <= self.budget:  # also False for nan
            return False
        return self.min_speedup is None or speedup >= self.min_speedup

    def __call__(self, key: Key) -> PlanScore:
        hit = self.cache.get(key)
        if hit is not None:
            return PlanScore(hit.error, hit.est_time, hit.est_speedup, hit.feasible,
                              hit.screened, True, hit.eval_error)
        est_time, speedup = self.timing(key)
        n = len(self.batches)
        if not math.isfinite(est_time):
            ev = PlanScore(math.inf, est_time, 0.0, False, screened=True)
        elif key == self.exact:
            ev = PlanScore(0.0, est_time, speedup, self.within(0.0, speedup))
        else:
            ev = None
            if self.sub_ref is not None:
                sub_err = self.error(key, self.sub_batches, self.sub_ref, "(screening)")
                self.evaluations += len(self.sub_batches) / n
                if not sub_err <= SCREEN_FACTOR * self.budget:
                    ev = PlanScore(sub_err, est_time, speedup, False, screened=True)
            if ev is None:
                err = self.error(key, self.batches, self.ref, "(calibration)")
                self.evaluations += 1.0
                ev = PlanScore(err, est_time, speedup, self.within(err, speedup))
        if ev.feasible and self.eval_batches is not None and self.eval_ref is not None:
            eval_err = self.error(key, self.eval_batches, self.eval_ref, "of eval_data")
            ev = PlanScore(ev.error, ev.est_time, ev.est_speedup,
                            self.within(eval_err, speedup), ev.screened, False, eval_err)
        if ev.feasible:
            audit_errors = self.audit(key)
            if audit_errors:  # a rule that did not run: the measured error is not the plan's
                ev = PlanScore(ev.error, ev.est_time, ev.est_speedup, False, ev.screened,
                                False, ev.eval_error, audit_error=audit_errors[0])
        if ev.feasible and self.extra_check is not None:
            ok, _info = self.extra_check(self.policy(key))
            ev = PlanScore(ev.error, ev.est_time, ev.est_speedup, ok, ev.screened, False,
                            ev.eval_error, ok)
        self.cache[key] = ev
        return ev


__all__ = ["PlanScorer", "SCORING_FP8_BACKEND", "SCREEN_FACTOR", "ScoringContext",
           "given_policy", "policy_for"]
