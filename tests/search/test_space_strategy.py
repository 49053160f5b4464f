"""The search space and the planned-trial strategy, on hand-made inputs."""

from __future__ import annotations

import math

from autoprec.search import select, strategy
from autoprec.search.evaluation import Evaluation
from autoprec.search.space import build_space, group_key


def _space(**kw):
    layers = ["a", "b", "c"]
    allowed = {"a": ["fp32", "bf16", "fp16", "fp8"], "b": ["fp32", "bf16", "fp16"],
               "c": ["fp32", "bf16", "fp16", "fp8"]}
    excluded = {"a": {"fp16": "fp16: overflow, max|y| 2.2e5 > 65504"},
                "b": {"fp8": "fp8: in_features 100 not a multiple of 16"}}
    return build_space(layers, allowed, excluded, ["fp32", "bf16", "fp16", "fp8"], **kw)


def test_choices_drop_excluded_and_keep_reasons():
    sp = _space()
    a, b, c = sp.variables
    assert a.choices == ["fp32", "bf16", "fp8"]  # fp16 removed: overflow
    assert b.choices == ["fp32", "bf16", "fp16"]
    assert c.choices == ["fp32", "bf16", "fp16", "fp8"]
    assert "65504" in sp.reasons()["a"]
    assert "multiple of 16" in sp.reasons()["b"]


def test_uniform_falls_back_to_the_nearest_more_precise_choice():
    sp = _space()
    assert sp.uniform("fp16") == {"a": "bf16", "b": "fp16", "c": "fp16"}
    assert sp.uniform("fp8") == {"a": "fp8", "b": "fp16", "c": "fp8"}


def test_locked_layers_are_not_variables():
    sp = _space(locked=["b"])
    assert [v.name for v in sp.variables] == ["a", "c"]
    assert sp.assignment({"a": "bf16"}) == {"b": "fp32", "a": "bf16", "c": "fp32"}


def test_repeated_blocks_are_grouped_above_the_variable_limit():
    layers = [f"h.{i}.{n}" for i in range(3) for n in ("q", "o")]
    allowed = {lay: ["fp32", "bf16"] for lay in layers}
    sp = build_space(layers, allowed, {}, ["fp32", "bf16"], max_variables=4)
    assert [v.name for v in sp.variables] == ["h.*.q", "h.*.o"]
    assert sp.variables[0].layers == ["h.0.q", "h.1.q", "h.2.q"]
    assert group_key("encoder.layer.11.attention.self.query") == "encoder.layer.*.attention.self.query"
    assert sp.assignment({"h.*.q": "bf16"})["h.2.q"] == "bf16"


def test_moves_are_ranked_by_gain_per_sensitivity_and_skip_slowdowns():
    sp = _space()
    speed = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5, "fp8": 0.3}

    def time_of(params):
        # layer c is small: fp8 there costs more than it saves
        t = sum(speed[params[v]] for v in ("a", "b"))
        return t + (1.2 if params["c"] == "fp8" else speed[params["c"]])

    sens = {("a", "bf16"): 0.001, ("a", "fp8"): 0.03, ("b", "bf16"): 0.1, ("b", "fp16"): 0.002,
            ("c", "bf16"): 0.004, ("c", "fp16"): 0.001, ("c", "fp8"): 0.001}
    moves = strategy.rank_moves(sp, time_of, lambda lay, p: sens[(lay, p)])
    assert ("c", "fp8") not in [(m.variable, m.precision) for m in moves]
    assert (moves[0].variable, moves[0].precision) == ("a", "bf16")  # 0.5 / 0.001
    scores = [m.score for m in moves]
    assert scores == sorted(scores, reverse=True)
    # a later move of a variable replaces an earlier one only if it saves more
    full = strategy.prefix_params(sp, moves, len(moves))
    assert full == {"a": "fp8", "b": "fp16", "c": "fp16"}


def test_bisection_finds_the_largest_feasible_prefix_in_log_steps():
    for n, best in [(100, 37), (100, 0), (100, 100), (1, 0), (7, 6)]:
        calls = []

        def feasible(k, best=best, calls=calls):
            calls.append(k)
            return k <= best

        assert strategy.bisect_prefix(n, feasible) == best
        assert len(calls) <= math.ceil(math.log2(n + 1)) + 1


def test_bisection_stops_when_the_budget_is_spent():
    answers = iter([False, True, None])
    assert strategy.bisect_prefix(100, lambda k: next(answers)) == 50


def _cand(n, err, t, feasible):
    return select.Candidate(n, {"a": str(n)}, Evaluation(err, t, 1.0 / t, feasible))


def test_choose_confirms_on_eval_data_fastest_first():
    cands = [_cand(0, 0.0, 1.0, True), _cand(1, 0.005, 0.5, True), _cand(2, 0.009, 0.4, True),
             _cand(3, 0.5, 0.2, False)]
    eval_err = {"0": 0.0, "1": 0.008, "2": 0.02}
    chosen, ok = select.choose(cands, budget=0.01, min_speedup=None,
                               confirm=lambda p: eval_err[p["a"]])
    assert ok and chosen.number == 1  # 2 was faster but failed on eval data
    assert chosen.eval_error == 0.008


def test_choose_reports_the_closest_when_nothing_is_feasible():
    cands = [_cand(0, 0.0, 1.0, False), _cand(1, 0.02, 0.5, False), _cand(2, 0.5, 0.2, False)]
    chosen, ok = select.choose(cands, budget=0.01, min_speedup=1.5, confirm=None)
    assert not ok
    # 0: speed short by 1/3; 1: budget over by 1 (100%), speed met; 2: way over budget
    assert chosen.number == 0


def test_pareto_front_is_non_dominated():
    cands = [_cand(0, 0.0, 1.0, True), _cand(1, 0.01, 0.5, True), _cand(2, 0.02, 0.6, True),
             _cand(3, 0.3, 0.2, False)]
    front = select.pareto_front(cands)
    assert [c.number for c in front] == [3, 1, 0]
