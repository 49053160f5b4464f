"""The rules that make the rows the decision is given (``evaluation.decision``), each as a
table of cases: rows (or a study's candidates) in, the rows picked, demoted or left out
and why. tune's ``confirm`` calls them; these tables are what "why this plan" reads from
besides ``decide``'s own (tests/evaluation/test_decision.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from autoprec.evaluation import decision as d
from autoprec.evaluation.rows import Row, label
from autoprec.policy import Policy

FP32, BF16_AC, FP16_AC, BF16_TO = (label("fp32"), label("bf16"), label("fp16"),
                                   label("bf16", "deploy"))


def row(name: str, role: str = "baseline", *, ok: bool = True, est: float | None = 1.0,
        default: str = "fp32", form: str = "train", rules: int = 0, trial: int | None = None,
        measured: tuple[float, float, float] | None = None) -> Row:
    pol = Policy(default=default, form=form, layers={f"l{i}": "bf16" for i in range(rules)})
    r = Row(name, role, pol, 0.0, ok, est, trial=trial, weight_bytes=100)
    if measured is not None:
        r.p10, r.speedup, r.p90 = measured
    return r


def cand(number: int, *, est_time: float, error: float = 0.001, ok: bool = True,
         eval_error: float | None = None, est_speedup: float = 1.0) -> SimpleNamespace:
    """A study's candidate as the rules read it (``search.select.Candidate``)."""
    return SimpleNamespace(number=number, calib=SimpleNamespace(
        est_time=est_time, error=error, eval_error=eval_error, feasible=ok,
        est_speedup=est_speedup))


# -- rule 1: by estimate ----------------------------------------------------------------

@dataclass
class Pick:
    name: str
    cands: list[SimpleNamespace]
    chosen: int  # trial number
    feasible: bool
    min_speedup: float | None = None


PICKS = [
    Pick("the fastest feasible", [cand(0, est_time=2.0), cand(1, est_time=1.0),
                                  cand(2, est_time=0.5, ok=False)], 1, True),
    Pick("equal time: the smaller error", [cand(0, est_time=1.0, error=0.004),
                                           cand(1, est_time=1.0, error=0.002)], 1, True),
    Pick("equal time and error: the earlier trial", [cand(3, est_time=1.0),
                                                     cand(2, est_time=1.0)], 2, True),
    Pick("none feasible: the closest to the budget",
         [cand(0, est_time=0.5, error=0.03, ok=False),
          cand(1, est_time=1.0, error=0.012, ok=False)], 1, False),
    Pick("none feasible: the eval error counts where it is worse",
         [cand(0, est_time=0.5, error=0.011, eval_error=0.05, ok=False),
          cand(1, est_time=1.0, error=0.02, ok=False)], 1, False),
    Pick("none feasible: the speed shortfall counts under --min-speedup",
         [cand(0, est_time=0.5, error=0.011, ok=False, est_speedup=1.0),
          cand(1, est_time=0.4, error=0.011, ok=False, est_speedup=2.0)], 1, False, 2.0),
]


@pytest.mark.parametrize("case", PICKS, ids=[c.name for c in PICKS])
def test_by_estimate(case: Pick) -> None:
    got, feasible = d.by_estimate(case.cands, budget=0.01, min_speedup=case.min_speedup)
    assert (got.number, feasible) == (case.chosen, case.feasible)


def test_by_estimate_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no completed trials"):
        d.by_estimate([], budget=0.01, min_speedup=None)


# -- eligibility: which rows may be written -----------------------------------------------

@dataclass
class Demote:
    name: str
    rows: list[Row]
    feasible: list[bool]  # after the rule, per row
    why: str  # the demoted rows' why_not (contains)
    min_speedup: float | None = None
    form: str = "deploy"


DEMOTES = [
    Demote("below --min-speedup: not feasible", [row(FP32, est=1.0), row(BF16_TO, est=2.5),
                                                row(BF16_AC, est=1.5)],
           [False, True, False], "below --min-speedup 2", min_speedup=2.0),
    Demote("no --min-speedup: nothing demoted", [row(FP32, est=0.1)], [True], "",
           min_speedup=None),
    Demote("--form train: a stored 16-bit row cannot train",
           [row(FP32), row(BF16_TO, default="bf16", form="deploy"), row(BF16_AC, default="bf16")],
           [True, False, True], d.NO_MASTERS, form="train"),
    Demote("--form deploy: stored rows stay", [row(BF16_TO, default="bf16", form="deploy")],
           [True], "", form="deploy"),
]


@pytest.mark.parametrize("case", DEMOTES, ids=[c.name for c in DEMOTES])
def test_demotions(case: Demote) -> None:
    d.demote_below_min_speedup(case.rows, case.min_speedup)
    d.demote_stored_under_train(case.rows, case.form)
    assert [r.feasible for r in case.rows] == case.feasible
    for r, was in zip(case.rows, case.feasible, strict=True):
        assert (case.why in r.why_not) if not was else r.why_not == ""


@pytest.mark.parametrize(("tuned_ok", "baselines", "instead"), [
    (True, [row(FP32)], False),  # a trial within budget: it is the choice
    (False, [row(FP32)], True),  # none: a baseline within budget may be written
    (False, [row(FP32, ok=False)], False),  # nothing within budget at all
])
def test_baselines_instead(tuned_ok: bool, baselines: list[Row], instead: bool) -> None:
    assert d.baselines_instead(tuned_ok, baselines) is instead


# -- what is timed -------------------------------------------------------------------------

def test_next_candidates_are_the_first_distinct_plans_that_train() -> None:
    rows = [row(f"c{i}", "candidate", default="bf16", rules=i % 3, trial=i) for i in range(6)]
    taken = {rows[0].key}  # the chosen plan's (rules=0)
    # c0 is the chosen plan, c3 the same plan again (rules 0): both skipped
    assert [r.name for r in d.next_candidates(rows, taken)] == ["c1", "c2"]
    taken = {rows[0].key}
    # only the plan with two rules trains: c1 and c4 (one rule) fail, c5 repeats c2's plan
    got = d.next_candidates(rows, taken, lambda r: len(r.policy.layers) == 2)
    assert [r.name for r in got] == ["c2"]
    made: list[str] = []

    def lazy():  # a row is made only when one more is wanted
        for r in rows[1:]:
            made.append(r.name)
            yield r
    d.next_candidates(lazy(), set(), n=1)
    assert made == ["c1"]


@dataclass
class Slow:
    name: str
    row: Row
    timed: bool


SLOWS = [
    Slow("a train-form one-liner under SLOW_TO_TIME", row(FP16_AC, default="fp16", est=0.35),
         False),
    Slow("at SLOW_TO_TIME it is timed", row(BF16_AC, default="bf16", est=d.SLOW_TO_TIME), True),
    Slow("fp32 is always timed", row(FP32, est=0.1), True),
    Slow("a deploy one-liner is timed however slow",
         row(BF16_TO, default="bf16", form="deploy", est=0.1), True),
    Slow("the tuned plan is timed however slow", row("tuned", "tuned", default="fp16", est=0.1),
         True),
]


@pytest.mark.parametrize("case", SLOWS, ids=[c.name for c in SLOWS])
def test_rows_to_time(case: Slow) -> None:
    kept = d.rows_to_time([case.row])
    assert (kept == [case.row]) is case.timed
    assert case.row.feasible is case.timed
    if not case.timed:
        assert case.row.why_not.startswith("not timed: estimated 0.35x")


# -- a training tune ------------------------------------------------------------------------

def test_training_tries_the_chosen_then_the_fastest_feasible() -> None:
    a, b, c, e = (cand(0, est_time=2.0), cand(1, est_time=1.0), cand(2, est_time=0.5, ok=False),
                  cand(3, est_time=1.0))
    assert [x.number for x in d.training_tries(a, [a, b, c, e])] == [0, 1, 3]


@dataclass
class Tries:
    name: str
    passes: dict[str, str]  # row name -> '' (passes) or why not
    got: str | None  # the row that trains (None: none)
    checked: list[str]
    why: str = ""  # the first row's why_not when none trains


TRIES = [
    Tries("the chosen plan trains", {"t0": ""}, "t0", ["t0"]),
    Tries("the next one trains", {"t0": "short run: gap", "t1": ""}, "t1", ["t0", "t1"]),
    Tries("MAX_TRIES distinct plans, then the first failure's reason",
          {"t0": "short run: a", "t1": "short run: b", "t2": "short run: c", "t3": ""}, None,
          ["t0", "t1", "t2"], "short run: a"),
]


@pytest.mark.parametrize("case", TRIES, ids=[c.name for c in TRIES])
def test_first_that_trains(case: Tries) -> None:
    rows = [row(f"t{i}", "tuned", default="bf16", rules=i) for i in range(4)]
    checked: list[str] = []

    def verdict(r: Row) -> str:
        checked.append(r.name)
        return case.passes[r.name]

    got = d.first_that_trains(((i, r) for i, r in enumerate(rows)), verdict)
    assert (None if got is None else got[1].name) == case.got
    assert checked == case.checked
    if case.got is None:
        assert (rows[0].feasible, rows[0].why_not) == (False, case.why)


@pytest.mark.parametrize(("form", "est", "bar", "why"), [
    ("deploy", 2.0, None, d.NO_MASTERS),  # stored weights cannot train
    ("train", 1.0, None, ""),  # timed rows: every one-liner is a choice
    ("train", 1.0, 1.005, ""),  # within SAME_SPEED of the tuned plan: could be written
    ("train", 1.0, 1.2, "not training-checked: estimated 1.00x, slower than the tuned plan's"
                        " 1.20x"),
])
def test_not_worth_training(form: str, est: float, bar: float | None, why: str) -> None:
    assert d.not_worth_training(form, est, bar).startswith(why)
    assert bool(d.not_worth_training(form, est, bar)) is bool(why)


# -- the timing step's second look, the pick, "as fast" -------------------------------------

@pytest.mark.parametrize(("policy", "cold"), [
    (Policy(default="bf16", form="train"), True),  # per-call casts of the masters
    (Policy(default="fp32", form="train", layers={"a": "bf16"}), True),
    (Policy(default="bf16", form="deploy"), False),  # stored: cast once
    (Policy(default="tf32", form="train"), False),  # no cast
])
def test_casts_per_call(policy: Policy, cold: bool) -> None:
    assert d.casts_per_call(policy) is cold


def test_cold_rows_and_keep_slower() -> None:
    rows = [row("tuned", "tuned", default="bf16", rules=2, measured=(1.8, 2.0, 2.2)),
            row(FP32, measured=(1, 1, 1)), row(BF16_AC, default="bf16", measured=(1.5, 1.6, 1.7)),
            row(BF16_TO, default="bf16", form="deploy", measured=(2.5, 2.6, 2.7)),
            row(FP16_AC, default="fp16", ok=False, measured=(3.0, 3.0, 3.0))]
    names = d.cold_rows(rows, rows[0])
    assert names == [FP32, "tuned", BF16_TO, BF16_AC]  # over budget: not timed again
    cold = {FP32: 0.9, "tuned": 1.5, BF16_TO: 2.7, BF16_AC: 1.6}
    shadow = [row(r.name, measured=(cold[r.name],) * 3) for r in rows if r.name in names]
    moved = d.keep_slower(rows, shadow, names)
    assert [m.name for m in moved] == ["tuned"]  # fp32 moved too, but it is the reference
    assert rows[0].speedup == 1.5 and rows[0].warm == (2.0, 1.8, 2.2)
    assert rows[3].speedup == 2.6 and rows[3].warm is None  # faster cold: keeps the first


@dataclass
class Rec:
    name: str
    rows: list[Row]
    winner: int | None
    measured: bool
    pick: str | None


RECS = [
    Rec("the winner where one was written", [row("tuned", "tuned", est=2.0), row(FP32)], 0,
        False, "tuned"),
    Rec("eval, not timed: the fastest estimate", [row("tuned", "tuned", est=1.5),
                                                  row(BF16_TO, est=1.8)], None, False, BF16_TO),
    Rec("timed: the measured speed-up ranks",
        [row("tuned", "tuned", est=2.5, measured=(1, 1.2, 1.3)),
         row(BF16_TO, est=1.8, measured=(1.5, 1.6, 1.7))], None, True, BF16_TO),
    Rec("nothing within budget", [row("tuned", "tuned", ok=False)], None, False, None),
]


@pytest.mark.parametrize("case", RECS, ids=[c.name for c in RECS])
def test_recommend(case: Rec) -> None:
    w = None if case.winner is None else case.rows[case.winner]
    got = d.recommend(case.rows, w, case.measured)
    assert (None if got is None else got.name) == case.pick


@pytest.mark.parametrize(("a", "b", "as_fast", "same"), [
    (1.0, 1.0, True, True),
    (1.0, 1.004, True, True),  # within SAME_SPEED either way
    (1.0, 1.006, False, False),
    (1.006, 1.0, True, False),  # a faster: as fast, not the same speed
])
def test_one_tolerance_for_as_fast(a: float, b: float, as_fast: bool, same: bool) -> None:
    assert d.SAME_SPEED == 0.005
    assert d.as_fast(a, b) is as_fast
    assert d.same_speed(a, b) is same
