"""A plan as a minimal policy, and what identifies a plan written as rules.

``policy_for`` builds the policy the search, its baselines and the timing step install
(no metadata besides the fingerprint, target and form); ``plan_id`` names the plan a policy
writes, so two rows of one name are one plan (timed once, never each other's runner-up).
"""

from __future__ import annotations

from collections.abc import Mapping

from autoprec.policy.schema import Policy


def plan_id(default: str, layers: Mapping[str, str], form: str
            ) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """What identifies a plan written as rules: its form, default and rules. A plan with
    no 16-bit tensor anywhere (fp32 or tf32, no rules) runs the same in both forms."""
    if default in ("fp32", "tf32") and not layers:
        form = "any"
    return form, default, tuple(sorted(layers.items()))


def policy_for(default: str, layers: Mapping[str, str], fingerprint: str | None = None,
               target: str | None = None, form: str = "train") -> Policy:
    """A minimal policy (no metadata besides the fingerprint, target and form)."""
    model = {"fingerprint": fingerprint} if fingerprint else {}
    return Policy(default=default, layers=dict(layers), model=model, form=form,
                  target={"device": target} if target else {})


__all__ = ["plan_id", "policy_for"]
