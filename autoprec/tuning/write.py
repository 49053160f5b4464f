"""tune's last stage: write the plan ``confirm.choose_plan`` decided.

The compact policy (+ Pareto front), the notes the user is told, MLflow artifacts; a
``TuneResult``. Which plan it is, and why, was decided before (``confirm.choose_plan``,
``evaluation.decision.decide``): this module only writes.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path
from typing import Any

import optuna
import torch

from autoprec._version import __version__
from autoprec.cost.step import step_metrics
from autoprec.evaluation.decision import same_speed
from autoprec.evaluation.speed_check import speed_metrics
from autoprec.io.paths import remove_stale_fronts
from autoprec.policy import Policy
from autoprec.search import compaction, select
from autoprec.search.space import SearchSpace
from autoprec.study.driver import trial_rows
from autoprec.study.export import policy_from_candidate
from autoprec.study.objective import given_policy
from autoprec.track import PlotPlans, Tracker, log_tune_artifacts
from autoprec.tuning import recipe_rows, train_choice
from autoprec.tuning.config import TuneConfig
from autoprec.tuning.confirm import Chosen
from autoprec.tuning.prepare import Prepared
from autoprec.tuning.result import RunCosts, SearchRecord, TrainCheckRuns, TuneResult, WrittenPlan
from autoprec.tuning.run import Search

#: Below this estimated gain of the best uniform precision, the batch is launch-bound.
LAUNCH_BOUND = 1.10


# -- the last stage: write -------------------------------------------------------------------

def _provenance(search: Search, cfg: TuneConfig) -> dict[str, Any]:
    return {
        "autoprec": __version__, "torch": str(torch.__version__),
        "optuna": optuna.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seed": cfg.search.seed, "sampler": "PlanSampler", "candidates": search.planner.method,
        "study": search.study_name, "storage": search.storage_desc,
        "data": search.meta["data"], "mlflow_run": search.meta.get("mlflow_run"),
        "fuse_groups": cfg.pricing.fuse_groups,  # "auto": fused runtimes' groups took one precision
    }


def _runs_alike_in_both_forms(policy: Policy) -> bool:
    """All fp32 (the fallback when nothing lower is within budget): no autocast, no
    weight stored lower — the tune's own form is written, not the baseline row's."""
    return policy.default == "fp32" and set(policy.layers.values()) <= {"fp32"}


def write(prep: Prepared, space: SearchSpace, search: Search, cfg: TuneConfig,
          tracker: Tracker, started: float, plan: Chosen) -> TuneResult:
    """Write ``plan`` (``confirm.choose_plan``: the decided candidate and its rules) as the
    policy, with its front and the tracker's artifacts; a ``TuneResult``."""
    cands, chosen, rules, speed = plan.candidates, plan.candidate, plan.rules, plan.speed
    provenance = _provenance(search, cfg)
    feasible = chosen.calib.feasible  # a baseline within budget may replace the closest plan
    provenance.update(prep.target.speed.provenance())
    policy = policy_from_candidate(space, chosen, feasible=feasible, eval_error=chosen.eval_error,
                                   meta=search.meta, provenance=provenance, rules=rules)
    policy.target["batch_size"] = prep.deploy_bs
    if chosen.policy and chosen.policy.get("form") and not _runs_alike_in_both_forms(policy):
        policy.form = chosen.policy["form"]  # a baseline of another form won
    if cfg.pricing.compile:
        policy.target["mode"] = "compile"
    bd = prep.cost.breakdown(policy)
    policy.metrics.update({"est_casts": bd.casts, "weight_bytes": prep.cost.weight_bytes(policy),
                           **speed_metrics(speed), **step_metrics(bd)})
    if not prep.reference.is_fp32:  # est_speedup stays over fp32 (DESIGN); this one over
        policy.reference = prep.reference.to_dict()  # the model as the user has it
        given = prep.cost.estimate(given_policy(prep.reference))
        mine = prep.cost.estimate(policy)
        policy.metrics["est_speedup_over_reference"] = (
            round(given / mine, 4) if 0 < mine < float("inf") else 0.0)
    if cfg.pricing.max_weight_mb is not None:
        policy.metrics["weight_budget_mb"] = cfg.pricing.max_weight_mb
    if chosen.number < 0:  # a baseline won the measurement: no trial of the study
        policy.provenance["trial"] = None
    if chosen.calib.train_fidelity is not None:
        policy.metrics["train_fidelity"] = chosen.calib.train_fidelity
    if cfg.pricing.form == "train":
        train_choice.scaler_reasons(prep.table, policy)
    verdict = train_choice.verdict_of(search.train_check, policy)
    if verdict is not None:  # the written plan's short run (--train-aware)
        policy.metrics.update({
            "train_check_passed": verdict.passed, "train_steps": verdict.steps,
            "train_eval_loss": _round(verdict.run.eval_loss),
            "train_fp32_eval_loss": _round(verdict.fp32.eval_loss),
            "train_loss_gap": _round(verdict.gap), "max_loss_gap": verdict.max_loss_gap})
    _note_headroom(prep, policy)
    recipe_notes = _versus_recipe(prep, policy, speed) if cfg.pricing.form == "train" else []
    policy.save(prep.out_path)
    remove_stale_fronts(prep.out_path)  # an earlier --pareto run's front files are not this run's
    front_pols, front_paths = _write_front(prep, space, search, cfg, cands, provenance)
    eval_error = chosen.eval_error if chosen.eval_error is not None else chosen.calib.error
    rows = trial_rows(search.study)
    sens = prep.table.to_frame() if prep.table is not None else None
    tracker.log_metrics({"error": min(eval_error, 1e30),  # held-out, as in the policy
                         "calibration_error": min(chosen.calib.error, 1e30),
                         "est_speedup": chosen.calib.est_speedup, "feasible": float(feasible),
                         **{k: v for k, v in policy.metrics.items()
                            if k in ("measured_speedup", "weight_bytes", "min_headroom",
                                     "est_step_us", "est_train_peak_mb")},
                         "evaluations": search.scorer.evaluations,
                         "trials": search.driver.ran})
    import pandas as pd

    plans = _plot_plans(prep, search, speed, chosen)
    log_tune_artifacts(tracker, policy_path=prep.out_path, sensitivity=sens,
                       trials=pd.DataFrame(rows), layers=per_layer(prep, space, policy),
                       chosen_trial=chosen.number, budget=cfg.budget.value,
                       workdir=prep.out_path.parent / ".autoprec" / search.study_name,
                       plans=plans)
    for p in front_paths:
        tracker.log_artifact(p, "front")
    tracker.finish("FINISHED")
    costs = RunCosts(seconds=time.monotonic() - started)  # up to the written plan
    train = search.train_check
    return TuneResult(
        plan=WrittenPlan(
            policy=policy, path=prep.out_path, feasible=feasible, error=chosen.calib.error,
            eval_error=eval_error, est_speedup=chosen.calib.est_speedup,
            budget=cfg.budget.value, front=front_pols, front_paths=front_paths,
            notes=search.notes + _launch_note(prep, space, cfg)
            + _one_liner_note(prep, policy, speed) + recipe_notes + [prep.target.speed.note]
            + ([f"priced with this model's ops {prep.target.speed.describe_op_times()}"]
               if prep.target.speed.timed else []),
            reference=prep.reference, weight_bytes=prep.reference.weight_bytes, speed=speed),
        search=SearchRecord(
            study_name=search.study_name, storage=search.storage_desc,
            trials=search.driver.ran, evaluations=search.scorer.evaluations,
            priced=search.planner.priced, measured=len(search.driver.by_key),
            complete=search.driver.complete, method=search.planner.method,
            trials_table=rows, plot_plans=plans, sensitivity=sens, graph=prep.graph),
        costs=costs,
        train_check=TrainCheckRuns(
            verdicts=[] if train is None else [v.to_dict() for v in train.verdicts()],
            table=train_choice.table_lines(train),
            seconds=0.0 if train is None else train.seconds,
            cpu_seconds=0.0 if train is None else train.cpu_seconds))


def _round(x: float) -> float:
    return float(f"{x:.6g}") if math.isfinite(x) else float(x)


def _plot_plans(prep: Prepared, search: Search, speed: Any, chosen: Any) -> PlotPlans:
    """pareto.png's alternatives: every plan the planner priced (its predicted error, as
    corrected by the measured ones; not for a metric budget, whose units the predictions
    do not share), fp32 and the one-liners as the last step scored them, the chosen plan."""
    import pandas as pd

    planner = search.planner
    priced = None
    if planner.prune and len(planner.times):
        priced = (planner.preds * planner.correction, prep.cost.fp32_time / planner.times)
    rows = [{"plan": r.name, "error": r.error, "est_speedup": r.est_speedup}
            for r in (speed.rows if speed is not None else [])
            if r.role == "baseline" and r.error is not None and r.est_speedup is not None]
    return PlotPlans(priced=priced, baselines=pd.DataFrame(rows) if rows else None,
                     chosen=(chosen.calib.error, chosen.calib.est_speedup))


def _note_headroom(prep: Prepared, policy: Policy) -> None:
    """The winner's headroom (evaluation.headroom: one fp32 pass over the calibration data):
    ``metrics.min_headroom`` (and its layer), and a reason for each layer under
    NOTE_BELOW — what a reviewer reads before choosing ``guard`` layers."""
    from autoprec.evaluation.headroom import NOTE_BELOW, measure_headroom, smallest
    from autoprec.fused import fused_paths_off
    from autoprec.plan import compile_plan
    from autoprec.policy import gemm_leaf_paths

    res = compile_plan(policy, prep.net).resolution()
    with fused_paths_off():
        rows = measure_headroom(prep.net, prep.calib, prep.spec.forward,
                                {p: (res[p].precision, res[p].region)
                                 for p in gemm_leaf_paths(prep.net) if p in res})
    low = smallest(rows)
    if low is None or not math.isfinite(low.headroom):
        return
    policy.metrics["min_headroom"] = round(low.headroom, 4)
    policy.metrics["min_headroom_layer"] = low.layer
    for r in rows:
        if r.headroom < NOTE_BELOW:
            had = policy.reasons.get(r.layer)
            policy.reasons[r.layer] = f"{had}; {r.note()}" if had else r.note()


def per_layer(prep: Prepared, space: SearchSpace, policy: Policy) -> dict[str, str]:
    """The precision every GEMM layer computes in under ``policy`` (not only the layers
    with a rule: the default's too), in the model's order — for the layers plot."""
    from autoprec.plan import compile_plan

    return compile_plan(policy, prep.net).assignment(space.layers)


def _write_front(prep: Prepared, space: SearchSpace, search: Search, cfg: TuneConfig,
                 cands: list[select.Candidate], provenance: dict[str, Any]
                 ) -> tuple[list[Policy], list[Path]]:
    if not cfg.search.pareto:
        return [], []
    out = prep.out_path
    pols, paths = [], []
    for i, c in enumerate(select.pareto_front(cands)):
        rules = search.decoder.rules(c)
        fp = policy_from_candidate(space, c, feasible=c.calib.feasible, eval_error=c.eval_error,
                                   meta=search.meta, provenance=provenance, rules=rules)
        path = out.with_name(f"{out.stem}.front{i}{out.suffix}")
        fp.save(path)
        pols.append(fp)
        paths.append(path)
    return pols, paths


def _versus_recipe(prep: Prepared, policy: Policy, speed: Any) -> list[str]:
    """Record in ``policy`` where it differs from the best fixed recipe that may be written
    (``tuning.recipe_rows``), and say it in a note."""
    if speed is None:
        return []
    best = recipe_rows.best_recipe(speed.rows)
    if best is None:
        return []
    diffs = recipe_rows.versus_best_recipe(prep.cost, policy, speed.rows, prep.table)
    recipe_rows.record(policy, speed.rows, diffs)
    if best.policy.layers == policy.layers and best.policy.default == policy.default:
        return [f"wrote the fixed recipe {best.name} ({best.est_speedup:.2f}x): the tuned "
                "plan does not beat it"]
    return [f"differs from the best fixed recipe, {best.name} ({best.est_speedup:.2f}x), "
            f"in {len(diffs)} layers (provenance.versus_recipe)"]


def _one_liner_note(prep: Prepared, policy: Policy, speed: Any) -> list[str]:
    """A policy with rules estimated as fast as a one-line baseline within budget: say why
    the one line is not the same plan (compaction would have written it otherwise) — which
    modules it would put in another precision."""
    if not policy.layers or speed is None:
        return []
    est = policy.metrics.get("est_speedup")
    for row in speed.rows:
        if (row.role != "baseline" or row.policy is None or not row.feasible
                or row.est_speedup is None or est is None
                or not same_speed(row.est_speedup, est)):
            continue
        base = row.policy.default
        diff = compaction.differences(prep.cost, (policy.default, policy.layers), (base, {}))
        if not diff:
            continue
        where = ", ".join(f"{_module_words(prep, p)} ({a} here)" for p, a, _b in diff[:4])
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        return [f"the one line `default: {base}` ({row.name}) is estimated as fast "
                f"({row.est_speedup:.2f}x) but is not the same plan, so it is not what was "
                f"written: it would also run {where}{more} in {base}"]
    return []


def _module_words(prep: Prepared, path: str) -> str:
    if not path:
        return "the model's own code"
    if path in {n.path for n in prep.graph.gemm_nodes}:
        return path
    return f"the ops of {path} outside its GEMM layers"


def _launch_note(prep: Prepared, space: SearchSpace, cfg: TuneConfig) -> list[str]:
    """The calibration batch is launch-bound on a GPU: every precision prices the same."""
    if cfg.pricing.batch_size is not None:
        return []
    best = max(prep.cost.speedup(Policy(default=p)) for p in space.region.choices)
    if best >= LAUNCH_BOUND:
        return []
    return [f"at the calibration batch size ({prep.calib_bs}) the forward is launch-bound on "
            f"{cfg.pricing.target}: no precision is estimated more than {best:.2f}x faster than "
            "fp32; give the deployment batch with --batch-size N"]


__all__ = ["LAUNCH_BOUND", "per_layer", "write"]
