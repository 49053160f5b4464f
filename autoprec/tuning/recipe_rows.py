"""A training tune's fixed-recipe rows, and what the written plan says about the best one.

The recipes (``evaluation.recipes``: torchtitan's NVFP4 with a bf16 tail, Megatron's
first/last bf16, torchao's auto filter, fp8 / MXFP8 / NVFP4 everywhere) are built from the
model's structure, scored on the tune's data the way the search scores its plans, priced
on the tune's cost model, and short-run checked with ``--train-aware`` like the tuned plan
(``recipes.recipe_rows``). ``evaluation.decision`` writes the tuned plan only when it beats
the best of them (``Fallback.RECIPE_FASTER``); when the tuned plan is written,
``versus_best_recipe`` names, per layer, where it differs from that recipe and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autoprec.evaluation.recipes import (
    LayerDiff,
    diff_provenance,
    differences,
    recipe_plans,
    recipe_rows,
)
from autoprec.evaluation.scoring_context import ScoringContext
from autoprec.policy import Policy


def tune_recipe_rows(cost: Any, ctx: ScoringContext, budget: float, precisions: Sequence[str],
                     train_aware: bool = False,
                     train_check: Callable[[Policy, str], str] | None = None) -> list[Any]:
    """The recipes' rows of a ``--form train`` tune ([] for a deploy-form tune): each
    scored as the search scores its plans (``ScoringContext.errors``: the eval data only
    within budget) and audited as the search audits them."""
    if ctx.form != "train":
        return []
    plans = recipe_plans(ctx.model, cost.graph, fingerprint=ctx.fingerprint,
                         target=ctx.target.name)
    return recipe_rows(cost, plans, lambda pol: ctx.errors(pol, budget), budget,
                       precisions=precisions, train_aware=train_aware, audit=ctx.audit,
                       train_check=train_check)


def best_recipe(rows: Sequence[Any]) -> Any:
    """The fastest recipe row that may be written (None: none may)."""
    ok = [r for r in rows if r.role == "recipe" and r.feasible and r.policy is not None
          and r.est_speedup is not None]
    return max(ok, key=lambda r: r.est_speedup, default=None)


def versus_best_recipe(cost: Any, policy: Policy, rows: Sequence[Any],
                       table: Any = None) -> list[LayerDiff]:
    """Where the written ``policy`` differs from the best recipe row, per GEMM leaf, with
    why: the policy's own reason for the layer, else what the recipe's precision alone
    would do there — the probe's end-to-end error (``table``) and the step's change priced
    on ``cost`` ([] when no recipe row may be written, or the policy is that recipe)."""
    best = best_recipe(rows)
    if best is None or best.policy.layers == policy.layers:
        return []
    leaves = [n.path for n in cost.graph.gemm_nodes if n.is_leaf]
    base = cost.estimate(policy)

    def why(path: str, recipe: str, plan: str) -> str:
        if path in policy.reasons:
            return policy.reasons[path]
        parts = []
        err = _e2e(table, path, recipe)
        if err is not None:
            parts.append(f"{recipe} alone: e2e error {err:.3g}")
        one = Policy(default=policy.default, layers={**policy.layers, path: recipe},
                     form=policy.form)
        delta = cost.estimate(one) - base
        if delta == delta and abs(delta) != float("inf"):  # finite
            parts.append(f"{recipe} here would change the step by {delta * 1e6:+.1f} us")
        return "; ".join(parts)

    return differences(policy, best.policy, leaves, why)


def _e2e(table: Any, path: str, precision: str) -> float | None:
    """The probe's end-to-end error of ``path`` alone in ``precision`` (None: not probed)."""
    if table is None:
        return None
    try:
        err = table.row(path, precision).e2e_error
    except KeyError:
        return None
    return None if err != err else float(err)  # NaN: not measured


def record(policy: Policy, rows: Sequence[Any], diffs: Sequence[LayerDiff]) -> None:
    """Put the comparison with the best recipe into the written policy
    (``provenance.versus_recipe``)."""
    best = best_recipe(rows)
    if best is None:
        return
    policy.provenance["versus_recipe"] = {
        **diff_provenance(best.name, diffs),
        "recipe_est_speedup": round(best.est_speedup, 4)}


__all__ = ["best_recipe", "record", "tune_recipe_rows", "versus_best_recipe"]
