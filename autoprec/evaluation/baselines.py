"""The baseline rows: what a user writes instead of a tuned policy, priced and scored.

``BASELINES``: all fp32, one global ``torch.autocast`` in bf16 and in fp16, uniform tf32
(where the target has it), and the one line every deployment uses,
``model.to(torch.bfloat16)`` / ``model.to(torch.float16)`` with its inputs cast — each as
the policy ``default: <p>`` with no rules, in the train form (autocast) or the deploy
form (weights stored 16-bit), which runs as that one line does
(benchmarks/apply_overhead.py: within 3 %; tests/plan/test_what_runs_is_priced.py).

``baseline_rows`` is the one builder, used by tune's last step
(``tuning.confirm.tune_baseline_rows``: the search's own errors where it scored that very
plan; a 16-bit model adds its own rows there, the model as given and its upcast to fp32
as the speed reference only) and by ``eval`` (``assess.beside_baselines``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autoprec.evaluation.rows import Row, label
from autoprec.policy import Policy

#: Baseline rows, in this order: what a user writes instead of a tuned policy, as
#: (precision, form): the uniform plan ``default: precision`` in that form.
BASELINES: tuple[tuple[str, str], ...] = (
    ("fp32", "train"), ("bf16", "train"), ("fp16", "train"), ("tf32", "train"),
    ("bf16", "deploy"), ("fp16", "deploy"))


def baseline_rows(cost: Any, errors: Callable[[Policy], tuple[float, float | None]],
                  budget: float | None, make_policy: Callable[[str, str], Policy], *,
                  precisions: Sequence[str] | None = None, train_aware: bool = False,
                  audit: Callable[[Policy], list[str]] | None = None,
                  baselines: Sequence[tuple[str, str]] = BASELINES,
                  train_check: Callable[[Policy, str], str] | None = None) -> list[Row]:
    """The one table of what a user writes instead of a tuned policy (``BASELINES``: fp32,
    one global autocast per precision, uniform tf32, ``model.to(bf16)`` / ``(fp16)``),
    used by tune's last step and by ``eval``: each row's error, estimated speed-up and
    weights on ``cost``, and whether it may be written instead of the tuned plan.

    ``errors(policy)``: (calibration-or-only error, eval-data error or None), in the
    budget's units; a RuntimeError means the model's own code refuses the plan (a row
    saying so). ``make_policy(precision, form)`` builds each baseline's policy;
    ``budget`` None: no budget known (only fp32 is then a choice); ``audit(policy)``:
    the audit's errors on a real forward; ``precisions``: what the user asked for;
    ``baselines``: the (precision, form) rows (default: ``BASELINES``); ``train_check``
    (``--train-aware``): (policy, row name) -> '' when it trains like fp32 by the short-run
    contract (``autoprec.training.short_run``), else why not — not run on a row estimated slower
    than fp32 (fp32 passes by definition and is faster).
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
        if not why and cost.cannot_run(pol):  # e.g. over the weight budget
            why = cost.cannot_run(pol)[0]
        if not why and train_aware and p != "fp32":
            if train_check is None:
                why = "not training-checked (--train-aware)"
            elif cost.speedup(pol) < 1.0:
                why = "not training-checked: estimated slower than fp32"
            else:
                why = train_check(pol, label(p, form))
        row = Row(label(p, form), "baseline", pol, err, not why, cost.speedup(pol),
                  why_not=why, weight_bytes=cost.weight_bytes(pol))
        row.source = (calib, evl)
        rows.append(row)
    return rows


def _first_line(err: BaseException) -> str:
    """An exception's first line, for a table cell."""
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:160]


__all__ = ["BASELINES", "baseline_rows"]
