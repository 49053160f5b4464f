"""tune's last step: the chosen plan beside its baselines, timed where the target is here.

The rows are the chosen plan, the next fastest feasible candidates (where timed) and the
baselines (``baselines.py``: fp32, one global autocast per precision, uniform tf32, the
``model.to(bf16)`` / ``model.to(fp16)`` one-liners; a 16-bit model's own rows), each with
its error and its speed-up priced the same way as the tuned plan.

The rows are judged by the one evaluation pipeline eval and check use (``evaluation.assess``):
the search scored and audited every row through the tune's ``Target`` (the same
``Target.apply`` / ``Target.audit``), and where the target is the device at hand the rows
are timed by ``assess.time_rows`` (interleaved rounds, eager or compiled as the
deployment runs), the step eval's ``--measure`` takes too. Which row is written is
``evaluation.decision.decide``'s (the one decision; its reasons are data): the fastest
*measured* one within budget — a tuned plan measured slower than fp32 or a one-liner
within budget is never written, the next candidate or the baseline is. Where the target is
not here, the estimates stand, and a 16-bit model's own layout (or, with no trial within
budget, the fastest baseline within it) is written when the decision says so. Every rule that
picks, demotes or leaves out a row is ``evaluation.decision``'s; this module builds the
rows and maps the winning row back to what ``write`` writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoprec.evaluation import decision
from autoprec.evaluation.assess import fill_train_bytes, time_rows
from autoprec.evaluation.baselines import BASELINES, baseline_rows
from autoprec.evaluation.decision import ByEstimate
from autoprec.evaluation.rows import Row, Timer
from autoprec.evaluation.scoring_context import ScoringContext
from autoprec.evaluation.speed_check import SpeedCheck
from autoprec.policy import Policy
from autoprec.search import select
from autoprec.study.objective import given_policy
from autoprec.tuning.prepare import reference_key
from autoprec.tuning.recipe_rows import tune_recipe_rows
from autoprec.tuning.train_choice import baseline_check, tuned_that_trains

if TYPE_CHECKING:
    from autoprec.probe.table import ProbeRow, SensitivityTable
    from autoprec.search.plan_score import PlanScore
    from autoprec.search.select import Candidate
    from autoprec.search.space import SearchSpace
    from autoprec.tuning.config import TuneConfig
    from autoprec.tuning.prepare import Prepared
    from autoprec.tuning.run import Search


@dataclass
class Chosen:
    """What tune writes: the candidate (a trial, or a baseline / the model as given as a
    pseudo-candidate, number -1), its (default, rules), the rows and the decision beside
    it, and every candidate of the study (the Pareto front is written from them)."""

    candidate: Candidate
    rules: tuple[str, dict[str, str]]
    speed: SpeedCheck
    candidates: list[Candidate]


def choose_plan(prep: Prepared, space: SearchSpace, search: Search, cfg: TuneConfig
                ) -> Chosen:
    """tune's decision: the study's completed trials (and, for a 16-bit model none of whose
    trials is within budget, the model as given), the fastest within budget by estimate
    (``evaluation.decision.by_estimate``), confirmed beside its baselines (``confirm_tune``: timed
    where the target is here, decided by ``evaluation.decision.decide``)."""
    from autoprec.study.driver import completed

    cands = completed(search.study)
    given = _given_candidate(prep, space)
    if given is not None and not any(c.calib.feasible for c in cands):
        # a 16-bit model: the model as given is within budget by definition (error 0), so
        # a search whose trials all failed or went over budget still writes it
        search.notes.append("no trial found a plan within budget; wrote the model as given "
                            f"({prep.reference.label()}): " + why_none_fits(prep.table, cands,
                                                                            cfg.budget.value))
        cands = [*cands, given]
    if not cands:
        raise search.driver.nothing_measured(search.study_name)
    chosen, feasible = decision.by_estimate(select.dedupe(cands), budget=cfg.budget.value,
                                            min_speedup=cfg.search.min_speedup)
    speed, chosen, rules = confirm_tune(prep, space, search, cfg, cands, chosen, feasible)
    return Chosen(chosen, rules, speed, cands)


def why_none_fits(table: SensitivityTable, cands: Sequence[Candidate], budget: float,
                  top: int = 3) -> str:
    """Why no lowered plan fitted, per layer: the closest plan measured, and for each
    precision the layers whose error alone (the probes' end-to-end run, else their
    estimate) is smallest against the budget."""
    parts = []
    done = [c for c in cands if c.calib.error is not None and math.isfinite(c.calib.error)]
    if done:
        best = min(done, key=lambda c: c.calib.error)
        parts.append(f"the closest of {len(done)} trials measured {best.calib.error:.3g} "
                     f"(budget {budget:g})")
    by_prec: dict[str, list[ProbeRow]] = {}
    for r in getattr(table, "rows", []):
        if math.isfinite(r.effect):
            by_prec.setdefault(r.precision, []).append(r)
    for prec, rows in sorted(by_prec.items()):
        rows.sort(key=lambda r: r.effect)
        named = ", ".join(f"{r.layer} {r.effect:.3g}" for r in rows[:top])
        parts.append(f"{prec} alone costs at least {rows[0].effect:.3g} ({named})")
    return "; ".join(parts) if parts else "nothing was measured"


def _given_candidate(prep: Prepared, space: SearchSpace) -> Candidate | None:
    """The model as given (a 16-bit model's own layout) as a candidate (no trial of the
    study): error 0, priced like every plan. None for an fp32 model."""
    from autoprec.search.plan_score import PlanScore

    refm = prep.reference
    if refm.is_fp32 or refm.islands:  # a mixed model's own layout is measured (reference_key)
        return None
    pol = given_policy(refm)
    t = prep.cost.estimate(pol)
    key = reference_key(space, refm) or space.uniform(refm.default)
    return select.Candidate(number=-1, params=space.params(key),
                            calib=PlanScore(0.0, t, prep.cost.fp32_time / t if t > 0 else 0.0,
                                             True, eval_error=0.0),
                            policy={"default": refm.default, "layers": refm.rules(),
                                    "form": "deploy"})


def confirm_tune(prep: Prepared, space: SearchSpace, search: Search, cfg: TuneConfig,
                 cands: Sequence[Candidate], chosen: Candidate, feasible: bool,
                 timer: Timer | None = None
                 ) -> tuple[SpeedCheck, Candidate, tuple[str, dict[str, str]]]:
    """tune's last step: the rows beside the chosen plan, timed where the tune's target
    (``prep.target``) is local (compiled, for a ``--compile`` tune); returns the check, the
    candidate to write and its (default, rules)."""
    ctx, searched, target = search.scorer.context, search.scorer.uniform_score, prep.target

    rules_of = search.decoder.rules  # recorded on the trial, else compacted (search/decode.py)

    def row(c: Candidate, name: str, role: str) -> Row:
        err = c.calib.error if c.eval_error is None else c.eval_error
        r = Row(name, role, ctx.policy(*rules_of(c), ctx.form), err,
                c.calib.feasible, c.calib.est_speedup, trial=c.number,
                why_not=_why_not(c.calib, cfg.budget.value))
        r.source = c
        r.weight_bytes = prep.cost.weight_bytes(r.policy)
        return r

    trainer = getattr(search, "train_check", None)  # --train-aware: train_choice.py
    if trainer is not None and feasible:
        chosen, first = tuned_that_trains(trainer, chosen, cands, row)
        rows = [first]
        feasible = first.feasible
    else:
        rows = [row(chosen, "tuned", "tuned")]
    # untimed rows: the estimates decide, and a one-liner estimated slower than a tuned
    # plan that trains cannot be written: not trained (train_choice.baseline_check)
    bar = rows[0] if feasible and not (target.local and cfg.pricing.measure) else None
    budget, precs, aware = cfg.budget.value, cfg.search.precisions, cfg.train_check.train_aware
    rows_after = tune_baseline_rows(prep.cost, ctx, budget, precs, aware,
                                    prep.reference,
                                    train_check=None if trainer is None
                                    else baseline_check(trainer, prep.cost.speedup, bar),
                                    searched=searched)
    # a training tune: the fixed recipes people copy, judged as the one-liners are
    rows_after += tune_recipe_rows(prep.cost, ctx, budget, precs, aware,
                                   None if trainer is None
                                   else baseline_check(trainer, prep.cost.speedup, bar))
    decision.demote_below_min_speedup(rows_after, cfg.search.min_speedup)
    timed = target.local and cfg.pricing.measure and (
        feasible or decision.baselines_instead(feasible, rows_after))
    if timed:
        nxt = sorted((c for c in select.dedupe(cands) if c.calib.feasible),
                     key=lambda c: (c.calib.est_time, c.number))
        rows += decision.next_candidates(
            (row(c, f"next candidate (trial {c.number})", "candidate") for c in nxt),
            {rows[0].key}, None if trainer is None else _passed(trainer))
    rows += rows_after
    fill_train_bytes(rows, prep.cost)
    # an explicit profile (tune(profile=...): tests, experiments) prices the timed batch by
    # itself too; else the target's cost model at the calibration batch (time_rows)
    at_batch = (None if not timed or prep.cost.op_times is not None else
                target.plan_cost(prep.graph, prep.calib_bs, net=prep.net,
                                 forward=prep.spec.forward, loss=prep.spec.loss,
                                 batch=prep.calib[0], profile=prep.cost.profile))
    timing = time_rows(decision.rows_to_time(rows) if timed else rows, target, prep.spec.forward,
                       prep.net, prep.calib[0], prep.graph,
                       measure=timed, at_batch=at_batch, timer=timer, seed=cfg.search.seed,
                       loss=prep.spec.loss,
                       not_measured="not measured (--no-measure)" if not cfg.pricing.measure else
                       "not measured: no plan within budget")
    decided = decision.decide(rows, timing, trains=trainer is not None,
                              estimate=ByEstimate(chosen.number, chosen.calib.est_speedup,
                                                  feasible))
    check = SpeedCheck(rows, decided, timing)
    win = decided.winner
    if win is None or win.role == "tuned":
        return check, chosen, rules_of(chosen)
    if win.role == "candidate":
        return check, win.source, rules_of(win.source)
    return check, *_baseline_candidate(prep, space, win)


def _passed(trainer: Any) -> Callable[[Row], bool]:
    """Whether a candidate row passed the short run already (only what trains is a
    choice)."""
    def passed(r: Row) -> bool:
        v = trainer.known(r.policy)
        return v is not None and v.passed

    return passed


def _why_not(ev: Any, budget: float) -> str:
    """Why a candidate is not within budget, for its row (empty when it is)."""
    if ev.feasible:
        return ""
    if ev.audit_error:
        return "no: a rule did not run"
    err = ev.error if ev.eval_error is None else max(ev.error, ev.eval_error)
    return "no: over budget" if err > budget else "no"


def _baseline_candidate(prep: Prepared, space: SearchSpace, win: Row
                        ) -> tuple[Candidate, tuple[str, dict[str, str]]]:
    """A baseline row as the candidate to write (no trial of the study) and its rules."""
    from autoprec.search.plan_score import PlanScore

    assert win.policy is not None
    p = win.policy.default
    calib, evl = win.source
    layers = dict(win.policy.layers)  # the model as given keeps its fp32 modules' rules
    pseudo = select.Candidate(number=-1, params=space.params(space.uniform(p)),
                              calib=PlanScore(calib, prep.cost.estimate(win.policy),
                                               win.est_speedup or 0.0, True, eval_error=evl),
                              policy={"default": p, "layers": layers, "form": win.policy.form})
    return pseudo, (p, layers)


#: The search's own score of ``default: p`` with no rules, where it measured that very
#: plan (``PlanScorer.uniform_score``; None: it did not).
Searched = Callable[[str], "PlanScore | None"]


def _uniform_errors(ctx: ScoringContext, p: str, budget: float, form: str,
                    searched: Searched | None = None) -> tuple[float, float | None]:
    """Errors (calibration; eval data, or None) of ``default: p`` with no rules: the
    search's own score when it measured that very plan (``searched``), else runs of the
    model. The eval data is run only when the calibration error is within budget (as the
    search does)."""
    if p == "fp32":
        return 0.0, None
    hit = searched(p) if searched is not None else None
    if form != ctx.form:  # the search ran its plans in its own form only
        hit = None
    known = (None, None) if hit is None else (hit.error, hit.eval_error)
    # as the search scored its plans
    return ctx.errors(ctx.policy(p, {}, form), budget, known)


def tune_baseline_rows(cost: Any, ctx: ScoringContext, budget: float, precisions: Sequence[str],
                       train_aware: bool = False, reference: Any = None,
                       baselines: Sequence[tuple[str, str]] = BASELINES,
                       train_check: Callable[[Policy, str], str] | None = None,
                       searched: Searched | None = None) -> list[Row]:
    """``baseline_rows`` as tune's last step scores them: the search's own errors where it
    measured that very plan (``searched``), the eval data only within budget, the audit as
    the search's (``ctx``). A 16-bit model (``reference`` not fp32) has its own rows
    (``reference_rows``)."""
    if reference is not None and not reference.is_fp32:
        return reference_rows(cost, ctx, budget, precisions, reference, searched)
    rows = baseline_rows(
        cost, lambda pol: _uniform_errors(ctx, pol.default, budget, pol.form, searched),
        budget, lambda p, form: ctx.policy(p, {}, form),
        precisions=precisions, train_aware=train_aware,
        audit=ctx.audit, baselines=baselines, train_check=train_check)
    decision.demote_stored_under_train(rows, ctx.form)  # asked for fp32 masters
    return rows


def reference_rows(cost: Any, ctx: ScoringContext, budget: float, precisions: Sequence[str],
                   reference: Any, searched: Searched | None = None) -> list[Row]:
    """The baselines of a 16-bit model (``reference.ModelReference``): fp32 as the speed
    reference only (an upcast of the model, not a choice: it is not the reference and holds
    twice its weights), the model as given (error 0: it is the reference), and the deploy
    one-liners at or below the model's precision (``model.to(torch.float16)`` for a bf16
    model) other than the model itself. The training form's rows (autocast over fp32
    masters) have no fp32 masters to run over."""
    from autoprec.workload.reference import offered

    name = reference.label()
    up = ctx.policy("fp32", {}, "deploy")
    rows = [Row("fp32 (model.float())", "baseline", up, None, False, cost.speedup(up),
                why_not=f"an upcast of the {name} model: the speed reference only",
                weight_bytes=cost.weight_bytes(up))]
    given = given_policy(reference, ctx.fingerprint, ctx.target.name)
    why = cost.cannot_run(given)
    err = 0.0  # exact for a uniform 16-bit model; a mixed one's fp32 rules are measured
    if reference.islands:
        err = ctx.error(given)
        if not why and not err <= budget:
            why = [f"over budget ({err:.3g} > {budget:g})"]
    rows.append(Row(f"the model as given ({name})", "baseline", given, err, not why,
                    cost.speedup(given), why_not=why[0] if why else "",
                    weight_bytes=cost.weight_bytes(given)))
    rows[-1].source = (err, None)
    for p in offered(reference.default, ("bf16", "fp16")):
        if p == "fp32" or (p == reference.default and not reference.islands):
            continue
        rows.extend(tune_baseline_rows(cost, ctx, budget, precisions,
                                       baselines=[(p, "deploy")], searched=searched))
    return rows


__all__ = ["Chosen", "choose_plan", "confirm_tune", "reference_rows", "tune_baseline_rows"]
