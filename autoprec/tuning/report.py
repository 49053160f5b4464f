"""``tune --report DIR``: the MLflow tables and plots as files, and the tuned plan beside
what a user would do instead — the baseline rows tune's last step built and scored
(``baselines.baseline_rows``: fp32, one global autocast per precision, the
``model.to(bf16)`` / ``model.to(fp16)`` one-liners; held-out error where the budget binds,
the whole forward priced on the target, measured where the target is this machine). One
builder of baseline rows: the report reads tune's, it does not score them again."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.tuning.result import TuneResult


def report_rows(result: TuneResult, regions: list[str]) -> list[dict[str, Any]]:
    """The tuned plan and the baselines of ``result.plan.speed`` whose precision the search
    could choose (``regions``), as table rows."""
    plan = result.plan
    rows = [{"plan": "tuned", "error": plan.eval_error, "est_speedup": plan.est_speedup,
             "weight_bytes": plan.policy.metrics.get("weight_bytes")}]
    speed = plan.speed
    for r in speed.rows if speed is not None else ():
        if r.role != "baseline" or r.policy is None or r.policy.default not in regions:
            continue
        rows.append({"plan": r.name, "error": r.error, "est_speedup": r.est_speedup,
                     "measured_speedup": r.speedup, "weight_bytes": r.weight_bytes})
    return rows


def write_report(folder: Path, result: TuneResult, regions: list[str],
                 layers: dict[str, str]) -> list[Path]:
    """Write ``tune --report DIR`` for ``result`` (a TuneResult); returns the files."""
    import pandas as pd

    from autoprec.track import write_tune_report

    written = write_tune_report(
        folder, sensitivity=result.search.sensitivity,
        trials=pd.DataFrame(result.search.trials_table), layers=layers,
        chosen_trial=result.policy.provenance.get("trial"), budget=result.plan.budget,
        baselines=pd.DataFrame(report_rows(result, regions)), plans=result.search.plot_plans)
    return sorted(written.values())


__all__ = ["report_rows", "write_report"]
