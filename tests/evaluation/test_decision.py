"""The one decision (``evaluation.decision.decide``) as a table of cases.

Each case is rows as the timing step leaves them (estimates; measured speed-ups with their
p10-p90 spread where timed) and asserts on the structured ``Decision``: the winner, the
runner-up and the rules of its reasons, in order. The words (``explain.render``) are checked
against the lines tune printed before the decision was data."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from autoprec.evaluation.decision import (
    ByEstimate,
    ColdConfirmed,
    ColdMove,
    Fallback,
    Retimed,
    Rule,
    Timing,
    decide,
)
from autoprec.evaluation.explain import render
from autoprec.evaluation.rows import Row, label
from autoprec.policy import Policy

FP32, BF16_AC, BF16_TO = label("fp32"), label("bf16"), label("bf16", "deploy")
NOT_HERE = Timing(note="no h100 here: estimated")
HERE = Timing(device="cpu", batch_size=16, how="1 torch thread", rounds=7)


def row(name: str, role: str, *, ok: bool = True, est: float = 1.0,
        measured: tuple[float, float, float] | None = None, rules: int = 0,
        default: str = "fp32", form: str = "deploy", weights: int = 100,
        faults: float | None = None) -> Row:
    layers = {f"l{i}": "bf16" for i in range(rules)}
    r = Row(name, role, Policy(default=default, layers=layers, form=form), 0.0 if ok else 0.5,
            ok, est, weight_bytes=weights, faults=faults)
    if measured is not None:
        r.p10, r.speedup, r.p90 = measured
    return r


def tuned(**kw: object) -> Row:
    kw.setdefault("rules", 2)
    kw.setdefault("default", "bf16")
    return row("tuned", "tuned", **kw)  # type: ignore[arg-type]


def fp32(**kw: object) -> Row:
    return row(FP32, "baseline", form="train", **kw)  # type: ignore[arg-type]


def bf16(**kw: object) -> Row:
    return row(BF16_TO, "baseline", default="bf16", weights=50, **kw)  # type: ignore[arg-type]


def given(**kw: object) -> Row:
    return row("the model as given (bf16)", "baseline", default="bf16", **kw)  # type: ignore[arg-type]


@dataclass
class Case:
    name: str
    rows: list[Row]
    timing: Timing
    winner: str | None  # the winning row's name
    rules: tuple[Rule, ...]  # after BY_ESTIMATE
    runner_up: str | None = None
    writes: bool = True
    trains: bool = False  # --train-aware: the baselines' short runs were checked
    check: dict[str, object] = field(default_factory=dict)  # reason field -> value


CASES = [
    Case("not timed: the tuned plan stands",
         [tuned(est=2.0), fp32(), bf16(est=1.5)], NOT_HERE, "tuned", (Rule.NOT_MEASURED,),
         runner_up=BF16_TO),
    Case("not timed, tuned over budget: the fastest baseline within budget",
         [tuned(ok=False, est=2.5), fp32(), bf16(est=1.5)], NOT_HERE, BF16_TO,
         (Rule.NOT_MEASURED, Rule.ESTIMATED_INSTEAD),
         check={"fallback": Fallback.BASELINE_WITHIN_BUDGET}),
    Case("not timed, a 16-bit model as given estimated faster than the plan",
         [tuned(est=1.2), given(est=1.9)], NOT_HERE, "the model as given (bf16)",
         (Rule.NOT_MEASURED, Rule.ESTIMATED_INSTEAD), check={"fallback": Fallback.GIVEN_FASTER}),
    Case("not timed, nothing within budget: the closest plan stands",
         [tuned(ok=False, est=2.5), fp32(ok=False)], NOT_HERE, "tuned", (Rule.NOT_MEASURED,)),
    Case("not timed, training tune: a checked one-liner estimated as fast is written",
         [tuned(est=1.5), fp32(), bf16(est=1.5)], NOT_HERE, BF16_TO,
         (Rule.NOT_MEASURED, Rule.ESTIMATED_INSTEAD), trains=True,
         check={"fallback": Fallback.CHECKED_ONE_LINER}),
    Case("not timed, training tune: a faster tuned plan stays",
         [tuned(est=2.0), fp32(), bf16(est=1.5)], NOT_HERE, "tuned", (Rule.NOT_MEASURED,),
         trains=True),
    Case("eval, not timed: nothing is marked", [tuned(est=2.0), fp32()], NOT_HERE, None,
         (Rule.NOT_MEASURED,), writes=False),
    Case("timed: the tuned plan is the fastest within budget",
         [tuned(measured=(1.8, 2.0, 2.2)), fp32(measured=(1, 1, 1)),
          bf16(measured=(1.2, 1.3, 1.4))], HERE, "tuned", (Rule.MEASURED_FASTEST,),
         runner_up=BF16_TO),
    Case("timed: a tuned plan slower than fp32 is not written",
         [tuned(est=1.8, measured=(0.5, 0.57, 0.6)), fp32(measured=(1, 1, 1)),
          bf16(ok=False, measured=(1.6, 1.7, 1.8))], HERE, FP32,
         (Rule.TUNED_SLOWER, Rule.WROTE_INSTEAD), check={"overlap": False}),
    Case("timed: the faster median is kept where the tuned plan overlaps it",
         [tuned(measured=(1.2, 1.4, 1.6)), fp32(measured=(1, 1, 1)),
          bf16(measured=(1.3, 1.5, 1.7))], HERE, BF16_TO,
         (Rule.TUNED_SLOWER, Rule.WROTE_INSTEAD), check={"overlap": True}),
    Case("timed: a simpler plan as fast within the noise is written",
         [tuned(measured=(1.4, 1.6, 1.8)), fp32(measured=(1, 1, 1)),
          bf16(measured=(1.3, 1.5, 1.7))], HERE, BF16_TO,
         (Rule.SIMPLER_TIE, Rule.WROTE_INSTEAD), runner_up="tuned"),
    Case("timed, nothing within budget timed: no winner",
         [tuned(ok=False, measured=(1.8, 2.0, 2.2)), fp32(ok=False)], HERE, None,
         (Rule.NOTHING_MEASURED,)),
    Case("timed, re-timed and cold-confirmed: the second looks follow the rule",
         [tuned(measured=(1.8, 2.0, 2.2)), fp32(measured=(1, 1, 1))],
         Timing(device="cpu", batch_size=16, rounds=7,
                retimed=Retimed(("tuned",), "tuned", 3.0, 1.1, FP32, 1.0, 1.0, still=False),
                cold=ColdConfirmed("tuned", (FP32, "tuned"), (ColdMove("tuned", 3, 2, None),))),
         "tuned", (Rule.MEASURED_FASTEST, Rule.RETIMED, Rule.COLD_CONFIRMED)),
    Case("timed, a row page-faulting every forward is named",
         [tuned(measured=(1.8, 2.0, 2.2), faults=15000.0), fp32(measured=(1, 1, 1))], HERE,
         "tuned", (Rule.MEASURED_FASTEST, Rule.PAGE_FAULTS)),
    Case("eval, timed: the fastest within budget, nothing written instead",
         [tuned(measured=(0.5, 0.6, 0.7)), fp32(measured=(1, 1, 1))], HERE, FP32,
         (Rule.TUNED_SLOWER,), writes=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_decision(case: Case) -> None:
    estimate = ByEstimate(trial=3, est_speedup=case.rows[0].est_speedup or 0.0, feasible=True)
    d = decide(case.rows, case.timing, estimate=estimate, writes=case.writes,
               trains=case.trains)
    assert (None if d.winner is None else d.winner.name) == case.winner
    if case.writes:
        assert d.rules == (Rule.BY_ESTIMATE, *case.rules)
    else:
        assert d.rules[1:] == case.rules
    if case.runner_up is not None:
        assert d.runner_up is not None and d.runner_up.name == case.runner_up
    main = d.reasons[2] if case.rules[0] is Rule.NOT_MEASURED and len(d.reasons) > 2 else (
        d.reasons[1])
    for key, value in case.check.items():
        assert getattr(main, key) == value, (key, main)
    assert isinstance(render(d), str) and render(d)  # every reason has words (or none)


def test_the_words_are_the_lines_tune_printed() -> None:
    """``render`` gives the reason lines of the f-strings the decision replaced."""
    rs = [tuned(est=1.8, measured=(0.5, 0.57, 0.6)), fp32(measured=(1.0, 1.0, 1.0))]
    assert render(decide(rs, HERE)) == (
        "tuned (est. 1.80x) measured 0.57x over fp32, slower than fp32 (no autocast) at "
        "1.00x (p10-p90 1.00-1.00x): wrote fp32 (no autocast) instead")
    rs = [tuned(measured=(1.8, 2.0, 2.2)), fp32(measured=(1.0, 1.0, 1.0))]
    assert render(decide(rs, HERE)) == (
        "tuned measured 2.00x over fp32 (p10-p90 1.80-2.20x), the fastest within budget; "
        "next fp32 (no autocast) 1.00x")
    rs = [tuned(ok=False, est=2.5), fp32(), bf16(est=1.5)]
    assert render(decide(rs, NOT_HERE)) == (
        "no h100 here: estimated; bf16 (model.to(bfloat16)) is estimated faster than the "
        "tuned plan (or is the fastest plan within budget): wrote it")
    rs = [tuned(measured=(1.4, 1.6, 1.8)), fp32(measured=(1, 1, 1)),
          bf16(measured=(1.3, 1.5, 1.7), rules=2)]
    assert render(decide(rs, HERE, writes=False)) == (
        "bf16 (model.to(bfloat16)) (2 rules) measured 1.50x (p10-p90 1.30-1.70x), tuned "
        "(2 rules) 1.60x (p10-p90 1.40-1.80x): as fast within the noise, the simpler plan is "
        "written (it holds 0.0 MB of weights, tuned 0.0 MB)")
