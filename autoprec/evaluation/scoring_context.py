"""What scoring and auditing a policy on the tune's model and data needs, as one value.

The search's objective (``study.objective.PlanScorer``) builds a ``ScoringContext`` once;
tune's last step (``tuning.confirm``: the baselines, a 16-bit model's own rows, the fixed
recipes of a training tune) scores and audits its rows through the same context, so every
row is applied, scored and audited exactly as the search's plans were: the policy applied
for the scoring target (the tune's ``Target`` with fp8 emulated, ``SCORING_FP8_BACKEND``),
its error against the reference on the calibration data, and on the eval data when that is
separate, its audit on one real forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.policy import Policy
from autoprec.policy.build import policy_for
from autoprec.pricing.target import Target
from autoprec.trace.graph import fingerprint as model_fingerprint
from autoprec.workload.loading import ModelSpec
from autoprec.workload.scoring import Reference, score

#: The search scores and audits its plans with fp8 emulated, as the probes run it: a
#: plan's error is then the one its probes predicted, on any machine. The deployment's
#: own backend (``Target.fp8_backend``) times the rows (tuning.confirm) and runs eval/check.
SCORING_FP8_BACKEND = "emulated"


@dataclass(frozen=True, eq=False)  # compared by identity: it holds a model and tensors
class ScoringContext:
    """The model, its data and references, and the targets a policy is scored on.

    ``target`` is the tune's (its name goes into every policy, its form is the form every
    plan of the search runs in); ``scoring`` is that target as the search scores on it
    (``SCORING_FP8_BACKEND``). ``eval_batches`` / ``eval_ref`` are None when the eval data
    is the calibration data."""

    spec: ModelSpec
    model: torch.nn.Module
    batches: Sequence[Any]
    ref: Reference
    eval_batches: Sequence[Any] | None
    eval_ref: Reference | None
    fingerprint: str
    target: Target
    scoring: Target

    @classmethod
    def build(cls, *, spec: ModelSpec, model: torch.nn.Module, batches: Sequence[Any],
              ref: Reference, target: Target, eval_batches: Sequence[Any] | None = None,
              eval_ref: Reference | None = None) -> ScoringContext:
        """The context of ``model`` for the tune's ``target``: its fingerprint taken and
        the scoring target derived once."""
        return cls(spec=spec, model=model, batches=batches, ref=ref,
                   eval_batches=eval_batches, eval_ref=eval_ref,
                   fingerprint=model_fingerprint(model), target=target,
                   scoring=dataclasses.replace(target, fp8_backend=SCORING_FP8_BACKEND))

    @property
    def form(self) -> str:
        """The form every plan of the search runs in (the tune's target's)."""
        return self.target.form

    def policy(self, default: str, layers: Mapping[str, str], form: str) -> Policy:
        """A minimal policy for this model and the tune's target, in ``form``."""
        return policy_for(default, layers, self.fingerprint, self.target.name, form)

    def _score(self, on_eval: bool) -> float:
        """The error of the model as it is now (a policy applied, or none)."""
        if on_eval:  # only where the eval data is separate (``eval_batches``)
            return score(self.spec, self.model, self.eval_batches, self.eval_ref,
                         "of eval_data").value
        return score(self.spec, self.model, self.batches, self.ref, "(calibration)").value

    def error(self, policy: Policy, on_eval: bool = False) -> float:
        """The error of ``policy``, applied as the search applies its plans, on the
        calibration data (or the eval data: ``on_eval``)."""
        with self.scoring.apply(self.model, policy):
            return self._score(on_eval)

    def errors(self, policy: Policy, budget: float,
               known: tuple[float | None, float | None] = (None, None)
               ) -> tuple[float, float | None]:
        """(calibration error, eval error or None) of ``policy``, applied once as the search
        applies its plans; the eval data only where it is separate and the calibration error
        is within ``budget`` (as the search does). An error already ``known`` is not run
        again."""
        calib, evl = known
        with self.scoring.apply(self.model, policy):
            if calib is None:
                calib = self._score(False)
            if evl is None and self.eval_batches is not None and calib <= budget:
                evl = self._score(True)
        return calib, evl

    def audit(self, policy: Policy) -> list[str]:
        """The audit's errors for ``policy`` (a plan or a baseline) on one real forward
        (empty: every rule ran)."""
        batch = (self.eval_batches or self.batches)[0]
        return self.scoring.audit(self.model, policy,
                                  lambda: self.spec.forward(self.model, batch)).errors


__all__ = ["SCORING_FP8_BACKEND", "ScoringContext"]
