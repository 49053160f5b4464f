"""The baseline rows: what a user writes instead of a tuned policy, priced and scored.

``BASELINES``: all fp32, one global ``torch.autocast`` in bf16 and in fp16, uniform tf32
(where the target has it), and the one line every deployment uses,
``model.to(torch.bfloat16)`` / ``model.to(torch.float16)`` with its inputs cast — each as
the policy ``default: <p>`` with no rules, in the train form (autocast) or the deploy
form (weights stored 16-bit), which runs as that one line does
(benchmarks/apply_overhead.py: within 3 %; tests/plan/test_what_runs_is_priced.py).

``baseline_rows`` is the one builder, used by tune's last step (``tune_baseline_rows``:
the search's own errors where it scored that very plan) and by ``eval``
(``assess.beside_baselines``). A 16-bit model adds its own rows (``reference_rows``):
the model as given, and its upcast to fp32 as the speed reference only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autoprec.policy import Policy
from autoprec.search.speed_rows import Row, label

#: Baseline rows, in this order: what a user writes instead of a tuned policy, as
#: (precision, form): the uniform plan ``default: precision`` in that form.
BASELINES: tuple[tuple[str, str], ...] = (
    ("fp32", "train"), ("bf16", "train"), ("fp16", "train"), ("tf32", "train"),
    ("bf16", "deploy"), ("fp16", "deploy"))


def _uniform_errors(ev: Any, p: str, budget: float, form: str
                    ) -> tuple[float, float | None]:
    """Errors (calibration; eval data, or None) of ``default: p`` with no rules: the
    search's own score when it measured that very plan, else runs of the model. The eval
    data is run only when the calibration error is within budget (as the search does)."""
    from autoprec.scoring import score
    from autoprec.search.decode import policy_for

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


def baseline_rows(cost: Any, errors: Callable[[Policy], tuple[float, float | None]],
                  budget: float | None, make_policy: Callable[[str, str], Policy], *,
                  precisions: Sequence[str] | None = None, train_aware: bool = False,
                  audit: Callable[[Policy], list[str]] | None = None,
                  baselines: Sequence[tuple[str, str]] = BASELINES) -> list[Row]:
    """The one table of what a user writes instead of a tuned policy (``BASELINES``: fp32,
    one global autocast per precision, uniform tf32, ``model.to(bf16)`` / ``(fp16)``),
    used by tune's last step and by ``eval``: each row's error, estimated speed-up and
    weights on ``cost``, and whether it may be written instead of the tuned plan.

    ``errors(policy)``: (calibration-or-only error, eval-data error or None), in the
    budget's units; a RuntimeError means the model's own code refuses the plan (a row
    saying so). ``make_policy(precision, form)`` builds each baseline's policy;
    ``budget`` None: no budget known (only fp32 is then a choice); ``audit(policy)``:
    the audit's errors on a real forward; ``precisions``: what the user asked for;
    ``baselines``: the (precision, form) rows (default: ``BASELINES``).
    """
    rows = []
    for p, form in baselines:
        ok, why = cost.profile.supports(p)
        if not ok:
            rows.append(Row(label(p, form), "baseline", None,
                            why_not=f"not on {cost.profile.name}"))
            continue
        pol = make_policy(p, form)
        try:
            calib, evl = (0.0, None) if p == "fp32" else errors(pol)
        except RuntimeError as err:  # e.g. a router's own .float() meets 16-bit weights
            rows.append(Row(label(p, form), "baseline", None,
                            why_not=f"does not run on this model: {_first_line(err)}"))
            continue
        err = calib if evl is None else evl
        if budget is None:
            why = "" if p == "fp32" else "no budget recorded"
        else:
            within = calib <= budget and (evl is None or evl <= budget)
            why = "" if within else f"over budget ({err:.3g} > {budget:g})"
        if not why and p != "fp32" and audit is not None:
            found = audit(pol)
            why = f"audit: {found[0]}" if found else ""
        if not why and precisions is not None and p not in precisions:
            why = "not in --precisions"
        if not why and train_aware and p != "fp32":
            why = "not training-checked (--train-aware)"
        if not why and cost.cannot_run(pol):  # e.g. over the weight budget
            why = cost.cannot_run(pol)[0]
        row = Row(label(p, form), "baseline", pol, err, not why, cost.speedup(pol),
                  why_not=why, weight_bytes=cost.weight_bytes(pol))
        row.source = (calib, evl)
        rows.append(row)
    return rows


def tune_baseline_rows(cost: Any, ev: Any, budget: float, precisions: Sequence[str],
                       train_aware: bool = False, reference: Any = None,
                       baselines: Sequence[tuple[str, str]] = BASELINES) -> list[Row]:
    """``baseline_rows`` as tune's last step scores them: the search's own errors where it
    measured that very plan, the eval data only within budget, the audit as the search's.
    A 16-bit model (``reference`` not fp32) has its own rows (``reference_rows``)."""
    from autoprec.search.decode import policy_for

    if reference is not None and not reference.is_fp32:
        return reference_rows(cost, ev, budget, precisions, reference)
    rows = baseline_rows(
        cost, lambda pol: _uniform_errors(ev, pol.default, budget, pol.form), budget,
        lambda p, form: policy_for(p, {}, ev.fingerprint, ev.target.name, form),
        precisions=precisions, train_aware=train_aware,
        audit=ev.audit_policy, baselines=baselines)
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
    from autoprec.reference import offered
    from autoprec.search.decode import policy_for
    from autoprec.search.plan_scorer import given_policy

    name = reference.label()
    up = policy_for("fp32", {}, ev.fingerprint, ev.target.name, "deploy")
    rows = [Row("fp32 (model.float())", "baseline", up, None, False, cost.speedup(up),
                why_not=f"an upcast of the {name} model: the speed reference only",
                weight_bytes=cost.weight_bytes(up))]
    given = given_policy(reference, ev.fingerprint, ev.target.name)
    why = cost.cannot_run(given)
    err = 0.0  # exact for a uniform 16-bit model; a mixed one's fp32 rules are measured
    if reference.islands:
        from autoprec.scoring import score

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


def _first_line(err: BaseException) -> str:
    """An exception's first line, for a table cell."""
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:160]


__all__ = ["BASELINES", "baseline_rows", "reference_rows", "tune_baseline_rows"]
