"""A training tune's choice (``--train-aware``): the plan written must train like fp32 by
the short-run contract (``autoprec.training.short_run``), and so must the one-liner written in
its place.

- The search itself trains nothing (every trial would cost a training run): the chosen
  plan is checked at the end, and when it fails the next fastest feasible candidates are
  (``MAX_TRIES`` in all); when none passes, the tuned row is infeasible with its reason.
- The one-liners — one global bf16 / fp16 autocast (``TrainingArguments(bf16=True)`` /
  ``fp16=True``, the latter with a GradScaler) and uniform tf32 — are checked by the same
  contract (``baselines.baseline_rows(train_check=…)``); one estimated slower than fp32 is
  not trained (fp32 passes by definition and is faster).
- Where the rows are not timed, a one-liner estimated slower than a tuned plan that passed
  (by more than ``SAME_SPEED``) cannot be written, so it is not trained: its row says so
  (``baseline_check(..., faster=...)``; a short run costs as much as the rest of the tune).
- Where the rows are not timed, a checked one-liner estimated as fast as the tuned plan
  (within ``SAME_SPEED``) is written instead (the decision's ``Fallback.CHECKED_ONE_LINER``,
  ``evaluation.decision.one_liner_instead``); where they are timed,
  ``evaluation.decision.decide`` picks the fastest measured row that passed, a simpler one
  among equals. A plan is never written over a faster checked one-liner.
- Gradient probes (``probe/grad_rules.py``) have already excluded the pairs whose gradients
  flush; ``scaler_reasons`` puts the layers that need the GradScaler into the policy's
  ``reasons``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autoprec.evaluation.decision import MAX_TRIES
from autoprec.policy import Policy
from autoprec.training.short_run import ShortRunCheck, ShortRunVerdict


def make_check(prep: Any, cfg: Any) -> ShortRunCheck | None:
    """The tune's short-run check (None without ``--train-aware``); nothing runs yet."""
    check = cfg.train_check
    if not check.train_aware:
        return None
    return ShortRunCheck.from_spec(prep.spec, steps=check.train_steps, lr=check.train_lr,
                                   seed=cfg.search.seed, max_loss_gap=check.max_loss_gap,
                                   fp8_backend=prep.target.fp8_backend)


def baseline_check(check: ShortRunCheck, speedup: Callable[[Policy], float] | None = None,
                   faster: Any = None) -> Callable[[Policy, str], str]:
    """``baseline_rows``' ``train_check``: '' when the one-liner passes, else why not.

    ``faster``: the tuned row when it passed its short run and the rows are not timed (the
    estimates decide); ``speedup``: the estimate of a policy. Whether a one-liner is worth
    its short run at all is ``evaluation.decision.not_worth_training``'s rule."""
    from autoprec.evaluation.decision import not_worth_training

    def run(policy: Policy, name: str) -> str:
        timed_bar = faster is not None and speedup is not None
        why = not_worth_training(policy.form, speedup(policy) if timed_bar else None,
                                 (faster.est_speedup or 0.0) if timed_bar else None)
        return why or check.check(policy, name).why_not()

    return run


def tuned_that_trains(check: ShortRunCheck, chosen: Any, cands: Sequence[Any],
                      make_row: Callable[[Any, str, str], Any]) -> tuple[Any, Any]:
    """(candidate, its tuned row): the first candidate in
    ``evaluation.decision.training_tries``' order that passes the short run
    (``decision.first_that_trains``: ``MAX_TRIES`` in all); when none does, the chosen
    plan's row marked infeasible with the first failure's reason."""
    from autoprec.evaluation.decision import first_that_trains, training_tries
    from autoprec.search import select

    first = make_row(chosen, "tuned", "tuned")
    tries = ((c, first if c is chosen else make_row(c, "tuned", "tuned"))
             for c in training_tries(chosen, select.dedupe(cands)))
    got = first_that_trains(
        tries, lambda r: check.check(r.policy, f"tuned (trial {r.trial})").why_not())
    return got if got is not None else (chosen, first)


def verdict_of(check: ShortRunCheck | None, policy: Policy) -> ShortRunVerdict | None:
    """The short run of the written policy (None: not checked)."""
    return None if check is None else check.known(policy)


def scaler_reasons(table: Any, policy: Policy) -> None:
    """Add to ``policy.reasons`` each layer whose fp16 gradients flush without loss scaling
    (``grad_rules``): fp16 there trains only with the GradScaler."""
    from autoprec.probe.grad_rules import needs_scaler_layers

    if table is None:
        return
    for layer, why in needs_scaler_layers(list(table)).items():
        had = policy.reasons.get(layer)
        if had is None or why not in had:
            policy.reasons[layer] = f"{had}; {why}" if had else why


def table_lines(check: ShortRunCheck | None) -> list[str]:
    """The short runs as a table for tune's output."""
    if check is None or not check.verdicts():
        return []
    vs = check.verdicts()
    head = (f"short training runs ({vs[0].steps} steps from one init, eval loss vs fp32's, "
            f"max gap {vs[0].max_loss_gap:.2%}; {check.seconds:.0f} s):")
    lines = [head, f"  {'plan':<34} {'eval loss':>10} {'gap':>9} {'scaler':>6} "
                   f"{'seconds':>8}  verdict"]
    ref = vs[0].fp32
    lines.append(f"  {'fp32':<34} {ref.eval_loss:>10.5g} {0.0:>+9.2%} {'-':>6} "
                 f"{ref.seconds:>8.1f}  reference")
    for v in vs:
        if v.run is v.fp32:
            continue
        verdict = "ok" if v.passed else "FAILED: " + "; ".join(v.reasons)
        lines.append(f"  {v.run.label[:34]:<34} {v.run.eval_loss:>10.5g} {v.gap:>+9.2%} "
                     f"{'yes' if v.run.scaler else 'no':>6} {v.run.seconds:>8.1f}  {verdict}")
    return lines


__all__ = ["MAX_TRIES", "baseline_check", "make_check", "scaler_reasons", "table_lines",
           "tuned_that_trains", "verdict_of"]
