"""tune's last step: the chosen plan beside its baselines, timed where the target is here.

The rows are the chosen plan, the next fastest feasible candidates (where timed) and the
baselines (``baselines.py``: fp32, one global autocast per precision, uniform tf32, the
``model.to(bf16)`` / ``model.to(fp16)`` one-liners; a 16-bit model's own rows), each with
its error and its speed-up priced the same way as the tuned plan.

The rows are judged by the one evaluation pipeline eval and check use (``search.assess``):
the search scored and audited every row through the tune's ``Target`` (the same
``Target.apply`` / ``Target.audit``), and where the target is the device at hand the rows
are timed by ``assess.time_rows`` (interleaved rounds, eager or compiled as the
deployment runs), the step eval's ``--measure`` takes too. The written plan is the fastest *measured* one within budget (``speed_rows.decide``):
a tuned plan measured slower than fp32 or a one-liner within budget is never written —
the next candidate or the baseline is, and the reason says why. Where the target is not
here, the estimates stand, and a 16-bit model's own layout is written when it is
estimated faster than the tuned plan (``_given_if_faster``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoprec.search.assess import fill_train_bytes, time_rows
from autoprec.search.baselines import tune_baseline_rows
from autoprec.search.speed_rows import Row, SpeedCheck, Timer

#: Candidates from the study timed after the chosen one (the next fastest feasible ones).
NEXT_CANDIDATES = 2


def confirm_tune(prep: Any, space: Any, search: Any, cfg: Any, cands: Sequence[Any],
                 chosen: Any, feasible: bool,
                 timer: Timer | None = None) -> tuple[SpeedCheck, Any, tuple[str, dict[str, str]]]:
    """tune's last step: the rows beside the chosen plan, timed where the tune's target
    (``prep.target``) is local (compiled, for a ``--compile`` tune); returns the check, the
    candidate to write and its (default, rules)."""
    from autoprec.cost import make_cost_model
    from autoprec.search import select
    from autoprec.search.decode import policy_for

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

    rows = [row(chosen, "tuned", "tuned")]
    rows_after = tune_baseline_rows(prep.cost, ev, cfg.budget, cfg.precisions, cfg.train_aware,
                                    prep.reference)
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
            if r.key not in seen:
                seen.add(r.key)
                rows.append(r)
    rows += rows_after
    fill_train_bytes(rows, prep.cost)
    # an explicit profile (tune(profile=...): tests, experiments) prices the timed batch by
    # itself too; else the target's cost model at the calibration batch (time_rows)
    at_batch = (None if not timed or prep.cost.op_times is not None else
                make_cost_model(prep.graph, prep.cost.profile, prep.calib_bs, target.mode,
                                form=target.form, step=target.form == "train",
                                fp8_backend=target.fp8_backend))
    check = time_rows(rows, target, prep.spec.forward, prep.net, prep.calib[0], prep.graph,
                      measure=timed, at_batch=at_batch, timer=timer, seed=cfg.seed,
                      loss=prep.spec.loss,
                      not_measured="not measured (--no-measure)" if not cfg.measure else
                      "not measured: no plan within budget")
    if not check.measured:
        instead = _given_if_faster(rows) or _best_baseline_if_infeasible(rows)
        if instead is None:
            return check, chosen, rules_of(chosen)
        check.winner = instead
        check.reason += (f"; {instead.name} is estimated faster than the tuned plan (or is "
                         "the fastest plan within budget): wrote it")
        return check, *_baseline_candidate(prep, space, instead)
    win = check.winner
    if win is not None and win.role != "tuned":
        check.reason += f": wrote {win.name} instead"
    if win is None or win.role == "tuned":
        return check, chosen, rules_of(chosen)
    if win.role == "candidate":
        return check, win.source, rules_of(win.source)
    return check, *_baseline_candidate(prep, space, win)


def _given_if_faster(rows: Sequence[Row]) -> Row | None:
    """A 16-bit model's own row (``reference_rows``) when the tuned plan is over budget or
    estimated slower: the written plan is never priced below the model as given."""
    tuned = rows[0]
    given = next((r for r in rows if r.role == "baseline" and r.feasible
                  and r.name.startswith("the model as given")), None)
    if given is None:
        return None
    if tuned.feasible and (tuned.est_speedup or 0.0) >= (given.est_speedup or 0.0):
        return None
    return given


def _best_baseline_if_infeasible(rows: Sequence[Row]) -> Row | None:
    """The fastest baseline within budget (by estimate; the simpler among equals) when the
    tuned plan is not within budget: a one-liner that meets the budget is written rather
    than the closest over-budget plan."""
    if rows[0].feasible:
        return None
    ok = [r for r in rows if r.role == "baseline" and r.feasible and r.policy is not None
          and r.est_speedup is not None]
    if not ok:
        return None
    return max(ok, key=lambda r: (r.est_speedup or 0.0, -len(r.policy.layers),
                                  -(r.weight_bytes or 0)))


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
    from autoprec.search import select
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


__all__ = ["NEXT_CANDIDATES", "confirm_tune"]
