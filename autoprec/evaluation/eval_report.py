"""``autoprec eval``: what a policy does to model.py, as one report (``eval --json``).

The policy applied to the model of model.py and judged by the one evaluation pipeline
(``evaluation.assess``: scored on the eval data, audited on a real forward, priced on the
target), then set beside its baselines (``assess.beside_baselines``: fp32, one global
autocast, the one-line casts), timed where the target is this machine and ``measure``
asks. ``check`` gates on the same pipeline (``autoprec.evaluation.check``); the CLI only parses and
prints (``cli/policy_cmds.py``). The fields mean what ``autoprec.evaluation.json_fields`` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoprec.evaluation.assess import assess, beside_baselines
from autoprec.evaluation.json_fields import (
    batch_size_from,
    feasible,
    number,
    reasons_json,
    speedup,
    verdict_reasons,
)
from autoprec.io.validate import check_batch_size
from autoprec.policy import Policy, load_policy
from autoprec.pricing.target import resolve_target
from autoprec.workload.checkpoint_spec import load_model
from autoprec.workload.loading import ModelSpec


@dataclass(frozen=True)
class Evaluation:
    """What ``autoprec.evaluate`` returns: the headline figures of ``eval --json``'s object,
    and that object itself (``report``; ``to_dict()``). ``error`` is the relative L2 error
    on the eval data; ``metric_drop`` the metric's drop (a metric given, else None);
    ``budget`` the policy's recorded budget (None: none); ``feasible`` None without one;
    ``est_speedup`` over all-fp32 on ``target`` at ``batch_size`` (None: the target cannot
    run the policy); ``layers`` one row per GEMM layer (rule, precision, computed, audit)."""

    error: float
    metric_drop: float | None
    budget: float | None
    est_speedup: float | None
    feasible: bool | None
    target: str
    batch_size: int
    layers: list[dict[str, Any]]
    audit_errors: list[str]
    report: dict[str, Any] = field(repr=False)

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> Evaluation:
        return cls(error=_float(report["error"]), metric_drop=_float(report.get("metric_drop")),
                   budget=report["budget"], est_speedup=report["est_speedup"],
                   feasible=report["feasible"], target=report["target"],
                   batch_size=report["batch_size"], layers=list(report["layers"]),
                   audit_errors=list(report["audit_errors"]), report=report)

    def to_dict(self) -> dict[str, Any]:
        """The ``eval --json`` object."""
        return dict(self.report)


def _float(value: Any) -> Any:
    """A JSON number back to a float ("inf" / "nan" are written as strings)."""
    return math.inf if value == "inf" else math.nan if value == "nan" else value


def eval_report(model: str | Path | ModelSpec, policy_path: str | Path | Policy,
                target: str | None = None, batch_size: int | None = None,
                force: bool = False, measure: bool = False,
                compile: bool | None = None) -> dict[str, Any]:
    """What ``eval --json`` prints: a policy on model.py (or a ModelSpec: a model in hand,
    ``autoprec.workload.inputs``) scored, audited and priced (``assess``), beside its baselines
    (``assess.beside_baselines``)."""
    check_batch_size(batch_size)  # autoprec.io.validate: [1, MAX_BATCH_SIZE]
    if not isinstance(model, ModelSpec):  # a checkpoint folder under a training plan: fp32
        form = (policy_path if isinstance(policy_path, Policy)
                else load_policy(policy_path)).form
        spec = load_model(model, masters=form == "train")
    else:
        spec = model
    net = spec.model()
    if isinstance(policy_path, Policy):
        policy_path.validate(net, force=force)
        pol, policy_path = policy_path, None
    else:
        pol = load_policy(policy_path, model=net, force=force)
    # the target resolved once, as check and tune resolve it: a local target priced on this
    # machine's calibration and op timings (a profile fitted on another CPU promised 1.82x
    # for a policy that ran 0.56x here)
    tgt = resolve_target(target, pol, compile=compile, batch_size=batch_size, measure=measure,
                         policy_path=policy_path)
    a = assess(spec, net, pol, target=tgt, force=force)
    sc, report, cost, bd = a.score, a.audit, a.cost, a.breakdown
    warns = list(report.warnings)
    if (note := a.casts_note()) is not None:  # dtype-dependent model code, another batch
        warns.append(note)
    use_drop = sc.metric_drop is not None
    budget = pol.metrics.get("budget")
    within = None if budget is None else bool(sc.value <= float(budget))
    runnable = not a.infeasible
    rooms = {h.layer: h.to_dict()["headroom"] for h in a.headroom}
    layers = []
    for row in report.rows:
        t = bd.by_module.get(row.layer)
        layers.append({"layer": row.layer, "rule": row.rule, "precision": row.expected,
                       "computed": row.computed, "ok": row.ok,
                       "est_time_us": None if t is None else round(t * 1e6, 4),
                       "headroom": rooms.get(row.layer),
                       "reason": pol.reasons.get(row.layer)})
    out: dict[str, Any] = {"model": spec.name,
                           "policy": pol.source if policy_path is None else str(policy_path),
                           "error": number(sc.error)}
    if use_drop:
        out["metric"] = number(sc.metric)
        out["metric_drop"] = number(sc.metric_drop)
    out.update({
        "budget": budget, "within_budget": within,
        "est_speedup": speedup(a.est_speedup, runnable=runnable),
        "feasible": feasible(sc.value, budget, runnable=runnable, audit_ok=report.ok),
        "target": tgt.name, "batch_size": a.batch_size,
        "batch_size_from": batch_size_from(batch_size, pol.batch_size), "mode": tgt.mode,
        "form": tgt.form, "weight_bytes": cost.weight_bytes(pol),
        "breakdown": {**bd.to_dict(), "audited_casts": report.casts},
        "fp8_backend": a.fp8_backend,
        "reasons": reasons_json(verdict_reasons(
            sc.value, budget, name="metric drop" if use_drop else "error",
            infeasible=a.infeasible, audit=report)),
        "infeasible": a.infeasible,
        "audit_errors": report.errors,
        "headroom": [{k: number(v) for k, v in h.to_dict().items()} for h in a.headroom],
        "guard": pol.guard.to_yaml(),
        "warnings": warns,
        "layers": layers,
    })
    if tgt.step and pol.form == "train" and spec.loss is not None:
        # the training form: a real step's backward audited too (apply.audit_step)
        bwd = _backward_audit(spec, net, pol, tgt, force)
        out["backward_audit"] = [r.to_dict() for r in bwd.rows]
        out["audit_errors"] = [*out["audit_errors"], *bwd.errors]
        if bwd.errors and out["feasible"]:
            out["feasible"] = False
    speed = beside_baselines(a, spec, net, pol, tgt, measure=measure, force=force)
    out["speed_source"] = tgt.speed.note
    out["baselines"] = speed.to_dict()
    if measure:
        row = speed.rows[0]
        out["measured"] = None if row.speedup is None else {
            "device": speed.device, "batch_size": speed.batch_size, "timing": speed.how,
            "speedup": round(row.speedup, 4), "p10": round(row.p10, 4),
            "p90": round(row.p90, 4), "rounds": speed.rounds}
    return out


def _backward_audit(spec: Any, net: Any, pol: Any, tgt: Any, force: bool) -> Any:
    """The backward half of ``apply.audit_step`` on one calibration batch (the gradients
    it leaves are dropped)."""
    from autoprec.apply.audit_step import TrainingStep, audit_step

    step = TrainingStep(net, spec.forward, spec.loss, spec.calibration_batches()[0])
    try:
        return audit_step(net, pol, step, target=tgt.name, fp8_backend=tgt.fp8_backend,
                          force=force)[1]
    finally:
        net.zero_grad(set_to_none=True)


__all__ = ["Evaluation", "eval_report"]
