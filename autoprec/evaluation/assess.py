"""The one evaluation pipeline of a policy on a target: score, audit, price, baselines, time.

tune's confirmation, ``check`` (the gate) and ``eval`` (the report) judge plans the same
way, through these steps on one resolved ``Target`` (``pricing.target``: it applies and
audits every policy, ``Target.apply`` / ``Target.audit``, and prices it,
``Target.cost_model``), and differ only in what they conclude:

1. **score** — the reference on the eval data, then the policy applied and scored against
   it (relative L2, or the metric drop), and where an output is non-finite, the first
   module that produced it;
2. **audit** — one real forward under the policy: every GEMM at its rule's precision,
   every rule run (``Target.audit``), and the casts it ran;
3. **price** — the whole forward traced on a calibration batch and priced under the
   policy's plan on the target at the deployment batch size (eager or compiled), the
   training step's loss included for the train form (``Target.plan_cost``, tune's price);
4. **beside the baselines, timed** (``time_rows``) — the plan next to what a user writes
   instead (``evaluation.baselines.baseline_rows``, the one table), each priced on the same
   cost model, and timed where the target is this machine (``timing.measure_rows``).

``assess`` runs steps 1-3 for one policy (``check``, ``eval``); ``beside_baselines`` is
eval's step 4 (the baselines scored on the eval data), decided by ``decision.decide``.
tune's confirmation (``tuning.confirm``) runs step 4 on the search's own scores and audits
(``baselines.tune_baseline_rows``), which the search made through the same ``Target``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.apply.audit import AuditReport
from autoprec.cost import Breakdown
from autoprec.evaluation.decision import Timing, decide
from autoprec.evaluation.headroom import Headroom, measure_headroom
from autoprec.evaluation.rows import Row, Timer
from autoprec.evaluation.speed_check import SpeedCheck
from autoprec.evaluation.timing import measure_rows
from autoprec.fused import fused_paths_off
from autoprec.policy import Policy
from autoprec.policy.modules import Resolved, gemm_leaf_paths
from autoprec.pricing.target import Target
from autoprec.trace import LayerGraph, trace
from autoprec.workload.loading import ModelSpec
from autoprec.workload.metrics import batch_size_of
from autoprec.workload.scoring import Reference, Score, first_nonfinite_module, reference, score


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
    cost: Any  # CostModel (eager or compiled forward, with or without the step)
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
           force: bool = False, capture_warnings: bool = False) -> Assessment:
    """Score, audit and price ``policy`` on ``net`` (built from ``spec``) for ``target``.

    ``target``: the run's one resolved target (``pricing.target.resolve_target``): the
    policy applied as it runs there (its fp8 backend), and its cost model prices the plan
    as tune does (on a local CPU, with the model's ops timed here), in its mode.
    The deployment batch is the target's (``Target.deploy_batch``: given, the policy's,
    else the calibration batch's). ``capture_warnings``: policy warnings raised while applying are collected in
    ``notes`` instead of being emitted (check reports them in its result).
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
        report = target.audit(net, policy, lambda: spec.run(net, batches[0], 0, "of eval_data"),
                              force=force)
        with target.apply(net, policy, force=force):
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
    bs = target.deploy_batch(calib0, graph.batch_size)
    # tune's price (Target.plan_cost): a training step's loss included
    cost = target.plan_cost(graph, bs, net=net, forward=spec.forward, loss=spec.loss,
                            batch=calib0)
    return Assessment(
        reference=ref, score=sc, audit=report, layers=layers, fp8_backend=backend,
        first_nonfinite=bad, graph=graph, cost=cost, breakdown=cost.breakdown(policy),
        est_speedup=cost.speedup(policy), infeasible=cost.cannot_run(policy),
        batch_size=bs, eval_batches=len(batches), notes=notes, headroom=headroom)


def time_rows(rows: list[Row], target: Target, forward: Callable[[Any, Any], Any],
              net: torch.nn.Module, batch: Any, graph: LayerGraph, *, measure: bool,
              not_measured: str, at_batch: Any = None, timer: Timer | None = None,
              seed: int = 0, force: bool = False, loss: Callable[[Any, Any], Any] | None = None
              ) -> Timing:
    """Step 4's timing: ``rows`` (a plan, its candidates, its baselines) timed on
    ``batch`` where the target is this machine and ``measure`` says so (interleaved rounds
    in the target's mode, ``timing.measure_rows``), else a ``Timing`` saying why not
    (``not_measured`` for a local target, the speed source's note for a remote one).
    ``at_batch``: the cost model at ``batch``'s size (default: the target's, of ``graph``):
    each timed row's estimate beside its measurement. ``loss``: a training-form target times
    training steps (``timing.measure_rows``)."""
    if not (measure and target.local):
        return Timing(note=target.speed.note if not target.local else not_measured)
    if at_batch is None:
        at_batch = target.plan_cost(graph, batch_size_of(batch) or 1, net=net,
                                    forward=forward, loss=loss, batch=batch)
    return measure_rows(rows, forward, net, batch, target, at_batch, timer=timer, seed=seed,
                        force=force, loss=loss)


def fill_train_bytes(rows: list[Row], cost: Any) -> None:
    """Each training-form row's estimated training-step memory (``cost.step.train_bytes``),
    shown beside its speed."""
    from autoprec.cost.step import train_bytes

    for r in rows:
        if r.policy is not None and r.train_bytes is None:
            r.train_bytes = train_bytes(cost, r.policy)


def beside_baselines(a: Assessment, spec: ModelSpec, net: torch.nn.Module, policy: Policy,
                     target: Target, *, measure: bool = False, force: bool = False
                     ) -> SpeedCheck:
    """eval's step 4: ``policy`` (assessed as ``a``) next to fp32, one global autocast per
    precision, uniform tf32 and the ``model.to(bf16/fp16)`` one-liners where the target
    has them — error on the eval data, estimated speed-up and weight bytes on ``a.cost``,
    and, with ``measure`` on a local target, timed (``time_rows``) at the calibration
    batch. Eval writes nothing, so no row is marked unless timed (then: fastest within
    budget)."""
    from autoprec.evaluation.baselines import baseline_rows
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
        with target.apply(net, base):
            return score(spec, net, batches, a.reference, "of eval_data").value, None

    rows += baseline_rows(a.cost, eval_error, None if budget is None else float(budget),
                          lambda p, form: Policy(default=p, form=form, model=model_id))
    fill_train_bytes(rows, a.cost)
    timing = time_rows(rows, target, spec.forward, net, spec.calibration_batches()[0], a.graph,
                       measure=measure, not_measured="not measured (no --measure)",
                       force=force, loss=spec.loss)
    # eval writes nothing: no row is marked unless timed (then the fastest within budget)
    return SpeedCheck(rows, decide(rows, timing, writes=False), timing,
                      mark="fastest within budget" if timing.measured else "written")


__all__ = ["Assessment", "assess", "beside_baselines", "first_nonfinite", "time_rows"]
