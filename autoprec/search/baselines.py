"""What a user would do instead of tuning: one global autocast per precision and the
``model.to(bf16)`` / ``model.to(fp16)`` one-liners (``confirm_speed.BASELINES``), measured
the way tune measures its own plan (held-out error where the budget binds; the whole
forward priced on the target) — the rows of ``tune --report``'s tuned-vs-baselines chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel
from autoprec.evaluate import score
from autoprec.search.objective import Evaluator, policy_for


def uniform_baselines(evaluator: Evaluator, cost: CostModel, regions: list[str]
                      ) -> list[dict[str, Any]]:
    """One row per region precision: ``{"plan", "error", "est_speedup"}``; ``error`` on the
    eval data when model.py has one (else the calibration data), in the budget's units."""
    held_out = evaluator.eval_batches is not None and evaluator.eval_ref is not None
    batches = evaluator.eval_batches if held_out else evaluator.batches
    ref = evaluator.eval_ref if held_out else evaluator.ref
    from autoprec.search.confirm_speed import BASELINES, label

    rows = []
    for prec, form in BASELINES:
        if prec not in regions:
            continue
        policy = policy_for(prec, {}, evaluator.fingerprint, evaluator.target, form)
        if prec == "fp32":
            err = 0.0
        else:
            try:
                with apply_policy(evaluator.model, policy, fp8_backend=evaluator.fp8_backend):
                    err = score(evaluator.spec, evaluator.model, batches, ref,
                                "(baseline)").value
            except RuntimeError:  # the model's own code refuses this form (mixed dtypes)
                err = float("inf")
        rows.append({"plan": label(prec, form), "error": err,
                     "est_speedup": cost.speedup(policy)})
    return rows


def write_report(folder: Path, result: Any, evaluator: Evaluator, cost: CostModel,
                 regions: list[str], layers: dict[str, str]) -> list[Path]:
    """``tune --report DIR``: the MLflow tables and plots as files, plus the tuned plan
    (``result``, a TuneResult) beside one global autocast per precision. Returns the files
    written."""
    import pandas as pd

    from autoprec.track import write_tune_report

    rows = [{"plan": "tuned", "error": result.eval_error, "est_speedup": result.est_speedup}]
    rows += uniform_baselines(evaluator, cost, regions)
    written = write_tune_report(
        folder, sensitivity=result.sensitivity, trials=pd.DataFrame(result.trials_table),
        layers=layers, chosen_trial=result.policy.provenance.get("trial"),
        budget=result.budget, baselines=pd.DataFrame(rows), plans=result.plot_plans)
    return sorted(written.values())


__all__ = ["uniform_baselines", "write_report"]
