"""One evaluation of a policy on model.py, staged like tune: score, audit, price.

``check`` (the gate) and ``eval`` (the report) both judge a policy the same way, so they
share this pipeline and differ only in what they conclude from it:

1. **score** — the fp32 reference on the eval data, then the policy applied and scored
   against it (relative L2, or the metric drop), and where an output is non-finite, the
   first module that produced it;
2. **audit** — one real forward under the policy: every GEMM at its rule's precision,
   every rule run (``apply.audit``), and the casts it ran;
3. **price** — the whole forward traced on a calibration batch and priced under the
   policy's plan on the target at the deployment batch size (eager or compiled);
4. **beside the baselines** (``beside_baselines``, eval's table) — the policy next to what
   a user writes instead (``search.baselines.baseline_rows``, the table tune's last step
   builds), each scored on the eval data, priced on the same cost model, and timed where
   the target is this machine (``measure_rows``, tune's timing path).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.apply.apply import apply_policy, audit_policy
from autoprec.apply.audit import AuditReport
from autoprec.cost import Breakdown
from autoprec.fused import fused_paths_off
from autoprec.loading import ModelSpec
from autoprec.metrics import batch_size_of
from autoprec.policy import Policy
from autoprec.policy.modules import Resolved, gemm_leaf_paths
from autoprec.probe.headroom import Headroom, measure_headroom
from autoprec.scoring import Reference, Score, first_nonfinite_module, reference, score
from autoprec.search.target import Target
from autoprec.trace import LayerGraph, trace


@dataclass
class Assessment:
    """What one evaluation of a policy found (see the module docs)."""

    reference: Reference
    score: Score
    audit: AuditReport
    layers: dict[str, Resolved]  # the applied plan's resolution of every module path
    fp8_backend: str | None
    first_nonfinite: tuple[str, int] | None  # (module path, eval batch) where inf/nan began
    graph: LayerGraph
    cost: Any  # CostModel or CompiledCostModel
    breakdown: Breakdown
    est_speedup: float  # over all-fp32 on the target (0 / inf as the cost model gives it)
    infeasible: dict[str, str]  # precision -> why the target cannot run it
    batch_size: int
    eval_batches: int
    notes: list[str] = field(default_factory=list)  # warnings captured while applying
    #: each 16-bit / GEMM-format layer's calibration max |x|, |y| vs its format's limit
    headroom: list[Headroom] = field(default_factory=list)

    @property
    def planned_casts(self) -> int:
        return self.breakdown.casts + self.breakdown.weight_casts

    def casts_note(self) -> str | None:
        """A note when the audited forward ran another number of casts than the plan
        prices (dtype-dependent model code, or a batch other than the traced one)."""
        if self.audit.casts == self.planned_casts:
            return None
        return (f"the audited forward ran {self.audit.casts} casts, the plan prices "
                f"{self.planned_casts}")


def first_nonfinite(spec: ModelSpec, model: torch.nn.Module,
                    batches: Sequence[Any]) -> tuple[str, int] | None:
    """(module path, batch index) of the first module whose output held inf/nan."""
    for i, b in enumerate(batches):
        path = first_nonfinite_module(spec, model, b)
        if path is not None:
            return path, i
    return None


def assess(spec: ModelSpec, net: torch.nn.Module, policy: Policy, *, target: Target,
           batch_size: int | None, force: bool = False, fp8_backend: str | None = None,
           capture_warnings: bool = False) -> Assessment:
    """Score, audit and price ``policy`` on ``net`` (built from ``spec``) for ``target``.

    ``target``: the run's one resolved target (``search.target.resolve_target``): its
    cost model prices the plan as tune does (on a local CPU, with the model's ops timed
    here), in its mode. ``batch_size``: the deployment batch (None: the policy's, else the
    calibration batch's). ``capture_warnings``: policy warnings raised while applying are
    collected in ``notes`` instead of being emitted (check reports them in its result).
    """
    batches = spec.eval_batches()
    calib0 = spec.calibration_batches()[0]
    ref = reference(spec, net, batches, "of eval_data")
    caught: list[warnings.WarningMessage] = []
    recording = warnings.catch_warnings(record=True) if capture_warnings else nullcontext()
    with recording as got:
        if capture_warnings:
            warnings.simplefilter("always")
            caught = got
        applied = dict(fp8_backend=fp8_backend, force=force, target=target.name)
        report = audit_policy(net, policy,
                              lambda: spec.run(net, batches[0], 0, "of eval_data"), **applied)
        with apply_policy(net, policy, **applied):
            sc = score(spec, net, batches, ref, "of eval_data")
            bad = first_nonfinite(spec, net, batches) if sc.nonfinite else None
    layers, backend = report.layers, report.fp8_backend
    notes = list(dict.fromkeys(str(w.message) for w in caught))
    # headroom: the fp32 model (the policy is removed) on the calibration data
    with fused_paths_off():
        headroom = measure_headroom(
            net, spec.calibration_batches(), spec.forward,
            {p: (layers[p].precision, layers[p].region) for p in gemm_leaf_paths(net)
             if p in layers})

    # The whole forward priced under the policy's plan at the deployment batch size (DESIGN:
    # "price at the deployment shape"): GEMMs, casts, norms, activations, GEMM-format scaling.
    graph = trace(net, calib0, forward=spec.forward, model_name=spec.name)
    bs = batch_size or policy.batch_size or batch_size_of(calib0) or graph.batch_size
    cost = target.cost_model(graph, bs)
    return Assessment(
        reference=ref, score=sc, audit=report, layers=layers, fp8_backend=backend,
        first_nonfinite=bad, graph=graph, cost=cost, breakdown=cost.breakdown(policy),
        est_speedup=cost.speedup(policy), infeasible=cost.cannot_run(policy),
        batch_size=bs, eval_batches=len(batches), notes=notes, headroom=headroom)


def beside_baselines(a: Assessment, spec: ModelSpec, net: torch.nn.Module, policy: Policy,
                     target: Target, *, measure: bool = False, force: bool = False) -> Any:
    """Step 4: ``policy`` (assessed as ``a``) next to fp32, one global autocast per
    precision, uniform tf32 and the ``model.to(bf16/fp16)`` one-liners where the target
    has them — error on the eval data, estimated speed-up and weight bytes on ``a.cost``,
    and, with ``measure`` on a local target, timed in the target's mode (compiled: one
    model copy per plan) at the calibration batch. A ``speed_rows.SpeedCheck``; eval
    writes nothing, so no row is marked unless timed (then: fastest within budget)."""
    from autoprec.search.baselines import baseline_rows
    from autoprec.search.speed_rows import Row, check_speed
    from autoprec.search.timing import measure_rows
    from autoprec.trace.graph import fingerprint

    budget = policy.metrics.get("budget")
    value = a.score.value

    def ok(err: float) -> bool:
        return budget is not None and err <= float(budget)

    rows = [Row("policy", "tuned", policy, value, ok(value) or budget is None,
                a.cost.speedup(policy), weight_bytes=a.cost.weight_bytes(policy))]
    # the baselines are built for this model: its fingerprint, so that applying them warns
    # of nothing (a fingerprint-less one warned "model.fingerprint: missing … (normal for a
    # hand-written policy)" about a file the user never wrote)
    model_id = {"fingerprint": fingerprint(net)}
    batches = spec.eval_batches()

    def eval_error(base: Policy) -> tuple[float, None]:
        with apply_policy(net, base, target=target.name):
            return score(spec, net, batches, a.reference, "of eval_data").value, None

    rows += baseline_rows(a.cost, eval_error, None if budget is None else float(budget),
                          lambda p, form: Policy(default=p, form=form, model=model_id))
    speed = target.speed
    if not (measure and speed.local):
        check = check_speed(rows, None)
        check.winner = None  # eval writes nothing: no row is marked
        check.reason = speed.note if not speed.local else "not measured (no --measure)"
        return check
    batch = spec.calibration_batches()[0]
    at_batch = target.cost_model(a.graph, batch_size_of(batch) or 1)
    check = measure_rows(rows, spec.forward, net, batch, speed.device, target.name, at_batch,
                         force=force, compile=target.compile)
    check.mark = "fastest within budget"
    return check


__all__ = ["Assessment", "assess", "beside_baselines", "first_nonfinite"]
