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
budget, the fastest baseline within it) is written when the decision says so. This module
builds the rows and maps the winning row back to what ``write`` writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoprec.evaluation.assess import fill_train_bytes, time_rows
from autoprec.evaluation.baselines import BASELINES, baseline_rows
from autoprec.evaluation.decision import ByEstimate, decide
from autoprec.evaluation.rows import Row, Timer
from autoprec.evaluation.speed_check import SpeedCheck
from autoprec.policy import Policy
from autoprec.search import select
from autoprec.study.objective import given_policy
from autoprec.tuning.prepare import reference_key
from autoprec.tuning.train_choice import baseline_check, tuned_that_trains


@dataclass
class Chosen:
    """What tune writes: the candidate (a trial, or a baseline / the model as given as a
    pseudo-candidate, number -1), its (default, rules), the rows and the decision beside
    it, and every candidate of the study (the Pareto front is written from them)."""

    candidate: Any
    rules: tuple[str, dict[str, str]]
    speed: SpeedCheck
    candidates: list[Any]


def choose_plan(prep: Any, space: Any, search: Any, cfg: Any) -> Chosen:
    """tune's decision: the study's completed trials (and, for a 16-bit model none of whose
    trials is within budget, the model as given), the fastest within budget by estimate
    (``search.select.choose``), confirmed beside its baselines (``confirm_tune``: timed
    where the target is here, decided by ``evaluation.decision.decide``)."""
    from autoprec.study.driver import completed

    cands = completed(search.study)
    given = _given_candidate(prep, space)
    if given is not None and not any(c.calib.feasible for c in cands):
        # a 16-bit model: the model as given is within budget by definition (error 0), so
        # a search whose trials all failed or went over budget still writes it
        search.notes.append("no trial found a plan within budget; wrote the model as given "
                            f"({prep.reference.label()})")
        cands = [*cands, given]
    if not cands:
        raise search.driver.nothing_measured(search.study_name)
    chosen, feasible = select.choose(cands, budget=cfg.budget, min_speedup=cfg.min_speedup)
    speed, chosen, rules = confirm_tune(prep, space, search, cfg, cands, chosen, feasible)
    return Chosen(chosen, rules, speed, cands)


def _given_candidate(prep: Any, space: Any) -> Any:
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


#: Candidates from the study timed after the chosen one (the next fastest feasible ones).
NEXT_CANDIDATES = 2


def confirm_tune(prep: Any, space: Any, search: Any, cfg: Any, cands: Sequence[Any],
                 chosen: Any, feasible: bool,
                 timer: Timer | None = None) -> tuple[SpeedCheck, Any, tuple[str, dict[str, str]]]:
    """tune's last step: the rows beside the chosen plan, timed where the tune's target
    (``prep.target``) is local (compiled, for a ``--compile`` tune); returns the check, the
    candidate to write and its (default, rules)."""
    from autoprec.cost import make_cost_model
    from autoprec.policy.build import policy_for

    ev, target = search.scorer, prep.target

    rules_of = search.decoder.rules  # recorded on the trial, else compacted (search/decode.py)

    def row(c: Any, name: str, role: str) -> Row:
        err = c.calib.error if c.eval_error is None else c.eval_error
        r = Row(name, role, policy_for(*rules_of(c), ev.fingerprint, target.name, ev.form), err,
                c.calib.feasible, c.calib.est_speedup, trial=c.number,
                why_not=_why_not(c.calib, cfg.budget))
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
    bar = rows[0] if feasible and not (target.local and cfg.measure) else None
    rows_after = tune_baseline_rows(prep.cost, ev, cfg.budget, cfg.precisions, cfg.train_aware,
                                    prep.reference,
                                    train_check=None if trainer is None
                                    else baseline_check(trainer, prep.cost.speedup, bar))
    for r in rows_after:  # the speed target binds on a baseline as on a trial
        if (r.feasible and cfg.min_speedup is not None
                and (r.est_speedup or 0.0) < cfg.min_speedup):
            r.feasible, r.why_not = False, f"below --min-speedup {cfg.min_speedup:g}"
    # no trial within budget, a baseline is: the baselines are what may be written (timed
    # where the target is here), never the closest over-budget plan
    fallback = not feasible and any(r.feasible and r.policy is not None for r in rows_after)
    timed = target.local and cfg.measure and (feasible or fallback)
    if timed:
        seen = {rows[0].key}
        nxt = sorted((c for c in select.dedupe(cands) if c.calib.feasible),
                     key=lambda c: (c.calib.est_time, c.number))
        for c in nxt:
            if sum(x.role == "candidate" for x in rows) >= NEXT_CANDIDATES:
                break
            r = row(c, f"next candidate (trial {c.number})", "candidate")
            if r.key not in seen and trainer is not None:  # only what trains is a choice
                v = trainer.known(r.policy)
                if v is None or not v.passed:
                    continue
            if r.key not in seen:
                seen.add(r.key)
                rows.append(r)
    rows += rows_after
    fill_train_bytes(rows, prep.cost)
    # an explicit profile (tune(profile=...): tests, experiments) prices the timed batch by
    # itself too; else the target's cost model at the calibration batch (time_rows)
    at_batch = (None if not timed or prep.cost.op_times is not None else
                make_cost_model(prep.graph, prep.cost.profile, prep.calib_bs, target.mode,
                                form=target.form, step=target.step,
                                fp8_backend=target.fp8_backend))
    timing = time_rows(rows_to_time(rows) if timed else rows, target, prep.spec.forward,
                       prep.net, prep.calib[0], prep.graph,
                       measure=timed, at_batch=at_batch, timer=timer, seed=cfg.seed,
                       loss=prep.spec.loss,
                       not_measured="not measured (--no-measure)" if not cfg.measure else
                       "not measured: no plan within budget")
    decision = decide(rows, timing, estimate=ByEstimate(chosen.number, chosen.calib.est_speedup,
                                                        feasible), trains=trainer is not None)
    check = SpeedCheck(rows, decision, timing)
    win = decision.winner
    if win is None or win.role == "tuned":
        return check, chosen, rules_of(chosen)
    if win.role == "candidate":
        return check, win.source, rules_of(win.source)
    return check, *_baseline_candidate(prep, space, win)


#: A training-form one-liner estimated below this share of fp32's speed is not timed: fp32
#: is timed beside it and within budget, so it could be written only by measuring more than
#: twice its estimate (where the target is here the estimate is priced from this machine's
#: own op timings). A 16-bit GEMM the CPU has no kernel for is where this binds: one global
#: fp16 autocast on an AVX512-BF16 EPYC, estimated 0.35x, times at 0.08x, and each of its
#: timed steps costs twelve fp32 steps.
SLOW_TO_TIME = 0.5


def rows_to_time(rows: list[Row]) -> list[Row]:
    """The rows worth timing: all but the training-form one-liners (other than fp32)
    estimated below ``SLOW_TO_TIME`` x fp32's speed; such a row is not written either, and
    says why."""
    keep = []
    for r in rows:
        pol = r.policy
        slow = (r.role == "baseline" and pol is not None and pol.form == "train"
                and not (pol.default == "fp32" and not pol.layers)
                and r.est_speedup is not None and r.est_speedup < SLOW_TO_TIME)
        if not slow:
            keep.append(r)
            continue
        if r.feasible:
            r.feasible = False
            r.why_not = (f"not timed: estimated {r.est_speedup:.2f}x, under "
                         f"{SLOW_TO_TIME:g}x of fp32's speed here")
    return keep


def _why_not(ev: Any, budget: float) -> str:
    """Why a candidate is not within budget, for its row (empty when it is)."""
    if ev.feasible:
        return ""
    if ev.audit_error:
        return "no: a rule did not run"
    err = ev.error if ev.eval_error is None else max(ev.error, ev.eval_error)
    return "no: over budget" if err > budget else "no"


def _baseline_candidate(prep: Any, space: Any, win: Row) -> tuple[Any, tuple[str, dict[str, str]]]:
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


def _uniform_errors(ev: Any, p: str, budget: float, form: str
                    ) -> tuple[float, float | None]:
    """Errors (calibration; eval data, or None) of ``default: p`` with no rules: the
    search's own score when it measured that very plan, else runs of the model. The eval
    data is run only when the calibration error is within budget (as the search does)."""
    from autoprec.policy.build import policy_for
    from autoprec.workload.scoring import score

    if p == "fp32":
        return 0.0, None
    key = ev.space.uniform(p)
    default, layers = ev.decoder.explicit(key)
    # rules equal to their region's precision install nothing: the same plan as default p
    hit = (ev.cache.get(key) if default == p and set(layers.values()) <= {p}
           and form == ev.form else None)
    calib, evl = (None, None) if hit is None else (hit.error, hit.eval_error)
    pol = policy_for(p, {}, ev.fingerprint, ev.target.name, form)
    with ev.scoring.apply(ev.model, pol):  # as the search scored its plans
        if calib is None:
            calib = score(ev.spec, ev.model, ev.batches, ev.ref, "(calibration)").value
        if evl is None and ev.eval_batches is not None and calib <= budget:
            evl = score(ev.spec, ev.model, ev.eval_batches, ev.eval_ref, "of eval_data").value
    return calib, evl


def tune_baseline_rows(cost: Any, ev: Any, budget: float, precisions: Sequence[str],
                       train_aware: bool = False, reference: Any = None,
                       baselines: Sequence[tuple[str, str]] = BASELINES,
                       train_check: Callable[[Policy, str], str] | None = None) -> list[Row]:
    """``baseline_rows`` as tune's last step scores them: the search's own errors where it
    measured that very plan, the eval data only within budget, the audit as the search's.
    A 16-bit model (``reference`` not fp32) has its own rows (``reference_rows``)."""
    from autoprec.policy.build import policy_for

    if reference is not None and not reference.is_fp32:
        return reference_rows(cost, ev, budget, precisions, reference)
    rows = baseline_rows(
        cost, lambda pol: _uniform_errors(ev, pol.default, budget, pol.form), budget,
        lambda p, form: policy_for(p, {}, ev.fingerprint, ev.target.name, form),
        precisions=precisions, train_aware=train_aware,
        audit=ev.audit_policy, baselines=baselines, train_check=train_check)
    if ev.form == "train":  # asked for fp32 masters: the stored 16-bit form cannot train
        for r in rows:
            if r.feasible and r.policy is not None and r.policy.form == "deploy":
                r.feasible, r.why_not = False, "--form train: it stores no fp32 masters"
    return rows


def reference_rows(cost: Any, ev: Any, budget: float, precisions: Sequence[str],
                   reference: Any) -> list[Row]:
    """The baselines of a 16-bit model (``reference.ModelReference``): fp32 as the speed
    reference only (an upcast of the model, not a choice: it is not the reference and holds
    twice its weights), the model as given (error 0: it is the reference), and the deploy
    one-liners at or below the model's precision (``model.to(torch.float16)`` for a bf16
    model) other than the model itself. The training form's rows (autocast over fp32
    masters) have no fp32 masters to run over."""
    from autoprec.policy.build import policy_for
    from autoprec.study.objective import given_policy
    from autoprec.workload.reference import offered

    name = reference.label()
    up = policy_for("fp32", {}, ev.fingerprint, ev.target.name, "deploy")
    rows = [Row("fp32 (model.float())", "baseline", up, None, False, cost.speedup(up),
                why_not=f"an upcast of the {name} model: the speed reference only",
                weight_bytes=cost.weight_bytes(up))]
    given = given_policy(reference, ev.fingerprint, ev.target.name)
    why = cost.cannot_run(given)
    err = 0.0  # exact for a uniform 16-bit model; a mixed one's fp32 rules are measured
    if reference.islands:
        from autoprec.workload.scoring import score

        with ev.scoring.apply(ev.model, given):
            err = score(ev.spec, ev.model, ev.batches, ev.ref, "(calibration)").value
        if not why and not err <= budget:
            why = [f"over budget ({err:.3g} > {budget:g})"]
    rows.append(Row(f"the model as given ({name})", "baseline", given, err, not why,
                    cost.speedup(given), why_not=why[0] if why else "",
                    weight_bytes=cost.weight_bytes(given)))
    rows[-1].source = (err, None)
    for p in offered(reference.default, ("bf16", "fp16")):
        if p == "fp32" or (p == reference.default and not reference.islands):
            continue
        rows.extend(tune_baseline_rows(cost, ev, budget, precisions,
                                       baselines=[(p, "deploy")]))
    return rows


__all__ = ["NEXT_CANDIDATES", "SLOW_TO_TIME", "Chosen", "choose_plan", "confirm_tune",
           "reference_rows", "rows_to_time", "tune_baseline_rows"]
