"""The model's own ops timed on this CPU (autoprec.measure.op_times) and priced with.

Real timings of a tiny model (milliseconds each), and the cost model checked against
op times set by hand, so every expected total is worked out below.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from autoprec.cost import get_profile
from autoprec.cost.model import make_cost_model
from autoprec.evaluation.decision import contradictions
from autoprec.evaluation.rows import Row
from autoprec.measure.op_runner import _Builder
from autoprec.measure.op_times import OpTimes, digest, is_conv, measure, measure_op_times
from autoprec.policy import Policy
from autoprec.trace import trace
from tests import zoo
from tests.helpers import check_speed, one_torch_thread
from tests.zoo import cnn, mlp


@pytest.fixture(scope="module")
def graph():  # noqa: ANN201
    case = mlp()
    return trace(case.model, case.batch)


@pytest.fixture(scope="module")
def timed(graph):  # noqa: ANN001, ANN201
    with one_torch_thread():
        return measure(graph.ops, graph.batch_size)


def test_every_op_but_a_cast_records_how_to_run_it(graph) -> None:  # noqa: ANN001
    ops = graph.ops.ops
    assert all(op.recipe is not None for op in ops if op.kind != "cast")
    linear = [op for op in ops if op.kind == "gemm"]
    assert [op.recipe["f"] for op in linear] == ["F.linear"] * 3
    x, w, b = linear[0].recipe["a"]
    assert (x["shape"], w["shape"], b["shape"]) == ([2, 100], [64, 100], [64])
    assert graph.ops.values[w["t"]].param == "fc1.weight"
    json.dumps(graph.to_json())  # recipes are plain JSON (graph --json prints them)


def test_each_gemm_is_timed_in_each_precision_and_each_other_op_in_each_dtype(
        graph, timed) -> None:  # noqa: ANN001
    gemms = [i for i, op in enumerate(graph.ops.ops) if op.kind == "gemm"]
    assert sorted(timed.compute) == gemms
    for i in gemms:
        assert set(timed.compute[i]) == {"fp32", "bf16", "fp16"}
        assert all(0 < s < 0.05 for s in timed.compute[i].values())
    gelu = next(i for i, op in enumerate(graph.ops.ops) if op.name == "gelu")
    assert set(timed.other[gelu]) == {"fp32", "bf16", "fp16"}
    # casts of the 2 x 64 activation between every pair of the three dtypes
    assert {k for k in timed.casts if k.startswith("128:")} == {
        f"128:{a}>{b}" for a in ("fp32", "bf16", "fp16") for b in ("fp32", "bf16", "fp16")
        if a != b}
    assert timed.module_call_s > 0
    # the same call twice (fc2 and head differ; layer norm once) is timed once
    assert timed.distinct <= 3 * (len(timed.compute) + len(timed.other))


def test_the_cost_model_prices_every_op_at_its_timed_seconds(graph, timed) -> None:  # noqa: ANN001
    ops = graph.ops.ops
    hand = OpTimes(graph.batch_size,
                   compute={i: {"fp32": 1e-3, "bf16": 3e-3, "fp16": 2e-3} for i in timed.compute},
                   other={i: {d: 1e-5 for d in v} for i, v in timed.other.items()},
                   casts={k: 1e-4 for k in timed.casts}, module_call_s=1e-6)
    cost = make_cost_model(graph, get_profile("cpu"), graph.batch_size, op_times=hand)
    n_gemm = sum(op.kind == "gemm" for op in ops)
    n_other = sum(op.kind != "gemm" and op.kind != "cast" and i in hand.other
                  for i, op in enumerate(ops))
    calls = len(graph.ops.calls)
    want = n_gemm * 1e-3 + n_other * 1e-5 + calls * 1e-6
    assert cost.fp32_time == pytest.approx(want, rel=1e-9)
    # the deploy form's bf16: the GEMMs at their bf16 seconds, the input cast to bf16 and
    # the output cast back to fp32 at the timed cast's
    pol = Policy(default="bf16", form="deploy")
    bd = cost.breakdown(pol)
    assert bd.parts["gemm"] == pytest.approx(n_gemm * 3e-3, rel=1e-9)
    assert bd.parts["cast"] == pytest.approx((bd.casts + bd.weight_casts) * 1e-4, rel=1e-9)
    # fp16 under autocast: every GEMM at 2 ms
    assert cost.breakdown(Policy(default="fp16")).parts["gemm"] == pytest.approx(
        n_gemm * 2e-3, rel=1e-9)
    with pytest.raises(ValueError, match="batch 2, priced at 4"):
        make_cost_model(graph, get_profile("cpu"), 4, op_times=hand)


def test_an_op_without_a_timing_keeps_the_roofline(graph, timed) -> None:  # noqa: ANN001
    prof = get_profile("cpu")
    plain = make_cost_model(graph, prof, graph.batch_size)
    empty = OpTimes(graph.batch_size)
    assert make_cost_model(graph, prof, graph.batch_size, op_times=empty).fp32_time == \
        pytest.approx(plain.fp32_time, rel=1e-12)


def test_compiled_cost_model_takes_the_timed_gemms(graph, timed) -> None:  # noqa: ANN001
    prof = get_profile("cpu")
    hand = OpTimes(graph.batch_size,
                   compute={i: {"fp32": 1e-3, "bf16": 3e-3, "fp16": 2e-3} for i in timed.compute})
    cost = make_cost_model(graph, prof, graph.batch_size, "compile", op_times=hand)
    assert cost.breakdown(Policy(default="bf16")).parts["gemm"] == pytest.approx(9e-3, rel=1e-9)


def test_compiled_fused_kernels_cost_at_least_their_ops_timed_one_by_one(graph, timed
                                                                         ) -> None:  # noqa: ANN001
    """On a CPU thread inductor's fused kernels do the activations' and norms' arithmetic:
    a compiled plan's fused part is the larger of the bytes' roofline and those ops' timed
    seconds (the others, e.g. adds, are left to the roofline)."""
    ops = graph.ops.ops
    fused = [i for i, op in enumerate(ops)
             if op.kind not in ("gemm", "attention", "view") and i in timed.other]
    heavy = [i for i in fused if ops[i].name in ("gelu", "native_layer_norm")]
    assert heavy == fused  # the MLP's GELU and LayerNorm

    def other(sec: float | None) -> float:
        times = None if sec is None else OpTimes(graph.batch_size, other={
            i: dict.fromkeys(("-", "fp32", "bf16", "fp16"), sec) for i in fused})
        cost = make_cost_model(graph, get_profile("cpu"), graph.batch_size, "compile",
                               op_times=times)
        return cost.breakdown(Policy(default="fp32")).parts["other"]

    roofline = other(None)
    assert other(1e-12) == pytest.approx(roofline, rel=1e-9)  # below it: the roofline
    slow = len(heavy) * 1e-2
    assert slow <= other(1e-2) <= slow + roofline


def test_compiled_adds_and_relus_keep_the_roofline() -> None:
    """Memory-bound ops (residual adds, ReLU) and ops inductor lowers otherwise than eager
    are priced by their bytes, however long eager took for them."""
    case = zoo.mha()
    g = trace(case.model, case.batch)
    fused = [i for i, op in enumerate(g.ops.ops) if op.name in ("add", "relu")]
    assert len(fused) >= 3

    def other(times: OpTimes | None) -> float:
        cost = make_cost_model(g, get_profile("cpu"), g.batch_size, "compile", op_times=times)
        return cost.breakdown(Policy(default="fp32")).parts["other"]

    slow = OpTimes(g.batch_size, other={i: dict.fromkeys(("-", "fp32", "bf16", "fp16"), 1e-2)
                                        for i in fused})
    assert other(slow) == pytest.approx(other(None), rel=1e-9)


def test_boolean_inputs_are_rebuilt_all_true() -> None:
    """An SDPA's boolean mask false everywhere masks every score, which the CPU flash
    kernel skips: the rebuilt mask attends everywhere, as a padding mask mostly does."""
    case = mlp()
    g = trace(case.model, case.batch)
    spec = {"t": 0, "shape": [2, 1, 3, 3], "stride": [9, 9, 3, 1], "dt": "bool"}
    assert _Builder(g.ops, 1.0).tensor(spec, None).all()


def test_convolutions_are_timed_channels_last_too_and_compiled_plans_take_those() -> None:
    """Inductor's CPU backend runs every convolution channels-last (oneDNN): the compiled
    cost model prices a convolution at that layout's time, eager at the model's own."""
    case = cnn()
    g = trace(case.model, case.batch)
    with one_torch_thread():
        got = measure(g.ops, g.batch_size)
    convs = [i for i, op in enumerate(g.ops.ops) if is_conv(op)]
    gemms = [i for i, op in enumerate(g.ops.ops) if op.kind == "gemm"]
    assert len(convs) == 2 and set(convs) < set(gemms)  # the head's Linear is no conv
    assert sorted(got.compute_cl) == convs
    assert all(set(got.compute_cl[i]) == {"fp32", "bf16", "fp16"} for i in convs)
    assert all(0 < s < 0.05 for i in convs for s in got.compute_cl[i].values())
    assert OpTimes.from_json(json.loads(json.dumps(got.to_json()))).compute_cl == got.compute_cl
    # priced: channels-last at 10x the model's layout tells the two apart
    hand = OpTimes(g.batch_size,
                   compute={i: {"fp32": 1e-3, "bf16": 1e-3, "fp16": 1e-3} for i in gemms},
                   compute_cl={i: {"fp32": 1e-2, "bf16": 1e-2, "fp16": 1e-2} for i in convs})
    prof = get_profile("cpu")
    eager = make_cost_model(g, prof, g.batch_size, op_times=hand)
    compiled = make_cost_model(g, prof, g.batch_size, "compile", op_times=hand)
    assert eager.breakdown(Policy(default="bf16")).parts["gemm"] == pytest.approx(
        len(gemms) * 1e-3, rel=1e-9)
    if torch.backends.mkldnn.is_available():
        assert compiled.breakdown(Policy(default="bf16")).parts["gemm"] == pytest.approx(
            (len(gemms) - len(convs)) * 1e-3 + len(convs) * 1e-2, rel=1e-9)


def test_weights_are_cycled_through_the_footprint_only_where_it_overflows_l2(
        graph, monkeypatch) -> None:  # noqa: ANN001
    """A stored weight is read cold where the forward's footprint overflows L2: the runner
    cycles each GEMM's weight through copies spanning it; where it fits, one hot copy."""
    from autoprec.measure import op_runner
    from autoprec.measure.ops import _footprint

    gemm = next(op for op in graph.ops.ops if op.kind == "gemm")
    foot = _footprint(graph.ops, 1.0)
    monkeypatch.setattr(op_runner, "_cache_bytes", lambda: {2: 1024, 3: 1 << 20})
    span = op_runner._span(foot)
    assert span == min(foot, 2 << 20) > 0
    runner = op_runner._Runner(graph.ops, 1.0, span)
    builder = op_runner._Builder(graph.ops, 1.0)
    args = builder.build(gemm.recipe["a"], torch.float32)
    kwargs = {k: builder.build(v, torch.float32) for k, v in gemm.recipe["k"].items()}
    copies = runner._weight_copies(gemm.recipe, args, kwargs)
    w, b = args[1], args[2]  # F.linear(x, weight, bias): both parameters
    assert len(copies) == min(op_runner.COPIES_MAX, -(-span // (4 * (w.numel() + b.numel()))))
    assert len({c[0][1].data_ptr() for c in copies}) == len(copies)  # distinct weights
    assert all(c[0][0] is args[0] for c in copies)  # the activation is not copied
    # the samples start after one run through the copies (the forward's steady state)
    cycles: list[int] = []
    monkeypatch.setattr(op_runner, "_time", lambda call, cycle=1: cycles.append(cycle) or 1.0)
    runner.seconds(gemm.recipe, torch.float32)
    assert cycles == [len(copies)]
    monkeypatch.setattr(op_runner, "_cache_bytes", lambda: {2: 1 << 30})
    assert op_runner._span(foot) == 0
    assert op_runner._Runner(graph.ops, 1.0, 0)._weight_copies(gemm.recipe, args, kwargs) == []
    op_runner._Runner(graph.ops, 1.0, 0).seconds(gemm.recipe, torch.float32)
    assert cycles == [len(copies), 1]


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_the_training_forms_16_bit_gemms_are_priced_as_the_stored_ones(
        graph, mode) -> None:  # noqa: ANN001
    """One global autocast's GEMMs read the casts it just made, yet are priced at the
    stored weight's (cold) timing, as ``model.to(bf16)``'s: priced hot, that row came out
    9-15 % optimistic in eager (benchmarks/results/train_form_gemms.md)."""
    ops = graph.ops.ops
    gemms = [i for i, op in enumerate(ops) if op.kind == "gemm"]
    hand = OpTimes(graph.batch_size,
                   compute={i: {"fp32": 1e-3, "bf16": 4e-4, "fp16": 2e-3} for i in gemms})
    cost = make_cost_model(graph, get_profile("cpu"), graph.batch_size, mode, op_times=hand)

    def gemm_s(pol: Policy) -> float:
        return cost.breakdown(pol).parts["gemm"]

    assert gemm_s(Policy(default="fp32")) == pytest.approx(3e-3, rel=1e-9)
    assert gemm_s(Policy(default="bf16", form="deploy")) == pytest.approx(1.2e-3, rel=1e-9)
    assert gemm_s(Policy(default="bf16")) == pytest.approx(1.2e-3, rel=1e-9)
    one = Policy(default="fp32", layers={"fc2": "bf16"})  # one autocast region
    assert gemm_s(one) == pytest.approx(2e-3 + 4e-4, rel=1e-9)


def test_op_times_at_another_batch_rebuild_the_scaled_tensors(graph) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    at4 = measure(graph.ops, 4 * graph.batch_size)
    assert at4.batch_size == 8
    assert {k for k in at4.casts if k.startswith("512:")}  # 8 x 64 activations
    cost = make_cost_model(graph, get_profile("cpu"), 8, op_times=at4)
    assert math.isfinite(cost.fp32_time) and cost.fp32_time > 0


def test_cached_per_op_set_batch_and_machine(graph, tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    assert measure_op_times(graph.ops, 2, tmp_path, machine="m", measure_now=False) is None
    first = measure_op_times(graph.ops, 2, tmp_path, machine="m", measure_now=True)
    files = list(tmp_path.glob("ops-*.json"))
    assert [f.name for f in files] == [f"ops-{digest(graph.ops, 2, 'm')}.json"]
    again = measure_op_times(graph.ops, 2, tmp_path, machine="m", measure_now=False)
    assert again is not None and again.to_json() == first.to_json() and again.cached
    assert digest(graph.ops, 2, "m") != digest(graph.ops, 2, "other machine")
    assert digest(graph.ops, 2, "m") != digest(graph.ops, 4, "m")
    files[0].write_text("{not json")  # a damaged cache file is measured again
    assert measure_op_times(graph.ops, 2, tmp_path, machine="m", measure_now=False) is None


# -- the timing step: re-timed where the measured order contradicts the estimate ---------------

def _rows() -> list[Row]:
    mk = [("fp32", "baseline", Policy(default="fp32"), 1.0),
          ("tuned", "tuned", Policy(default="bf16", layers={"fc1": "fp32"}), 1.05),
          ("bf16", "baseline", Policy(default="bf16"), 2.0)]
    rows = []
    for name, role, pol, est in mk:
        r = Row(name, role, pol, 0.0, True, est)
        r.est_measured_batch = est
        rows.append(r)
    return rows


def test_contradictions_need_both_the_noise_and_the_estimates_margin() -> None:
    rows = _rows()
    fp32, tuned, bf16 = rows
    for r, (med, p10, p90) in zip(rows, [(1, 1, 1), (1.5, 1.4, 1.6), (1.0, 0.95, 1.05)],
                                  strict=True):
        r.speedup, r.p10, r.p90 = med, p10, p90
    # tuned measured above bf16 beyond the noise (p10 1.4 > p90 1.05) where the estimate
    # had bf16 faster, and tuned's estimate 1.05 is more than 20 % below its p10: a
    # contradiction. fp32 vs bf16: measured equal within the noise: none.
    assert [(a.name, b.name) for a, b in contradictions(rows)] == [("tuned", "bf16")]
    bf16.p90 = 1.45  # the ranges overlap: within the noise, no contradiction
    assert contradictions(rows) == []
    # a flip within the estimate's error: tuned est 1.19 (x 1.2 = 1.43 >= p10 1.4), bf16
    # est 1.2 (<= p90 1.05 x 1.2 = 1.26)
    bf16.p90, bf16.est_measured_batch, tuned.est_measured_batch = 1.05, 1.2, 1.19
    assert contradictions(rows) == []
    bf16.est_measured_batch = 1.3  # bf16's estimate 24 % above its p90: re-time
    assert [(a.name, b.name) for a, b in contradictions(rows)] == [("tuned", "bf16")]


def test_a_contradicted_timing_is_timed_again_before_it_decides() -> None:
    calls: list[list[str]] = []

    def timer(plans):  # noqa: ANN001, ANN202 - first a fluke for "tuned", then the truth
        calls.append(sorted(plans))
        fluke = len(calls) == 1
        per = {"fp32": 1.0, "bf16": 0.5, "tuned": 0.3 if fluke else 0.95}
        rng = np.random.default_rng(len(calls))
        return {n: list(per[n] * (1 + 0.01 * rng.standard_normal(9))) for n in plans}

    check = check_speed(_rows(), timer, device="cpu", batch_size=2)
    assert calls == [["bf16", "fp32", "tuned"], ["bf16", "fp32", "tuned"]]
    assert check.retimed == ("tuned", "bf16")
    assert check.winner is not None and check.winner.name == "bf16"
    assert "re-timed tuned, bf16" in check.reason and "no longer contradicts" in check.reason
    assert check.to_dict()["retimed"] == ["tuned", "bf16"]


def test_a_timing_the_estimate_agrees_with_is_not_repeated() -> None:
    calls = []

    def timer(plans):  # noqa: ANN001, ANN202
        calls.append(1)
        per = {"fp32": 1.0, "bf16": 0.5, "tuned": 1.1}
        return {n: [per[n]] * 9 for n in plans}

    check = check_speed(_rows(), timer, device="cpu", batch_size=2)
    assert len(calls) == 1 and check.retimed == ()


@pytest.mark.parametrize(("pol", "form"), [
    (Policy(default="fp32"), "train"),
    (Policy(default="fp32", layers={"fc1": "bf16"}), "train"),
    (Policy(default="bf16", form="deploy"), "deploy"),
    (Policy(default="fp32", layers={"fc1": "bf16"}, form="deploy"), "deploy"),  # + consumers
])
def test_each_call_through_an_installed_wrapper_costs_the_timed_wrapper(
        graph, timed, pol: Policy, form: str) -> None:  # noqa: ANN001
    """The wrappers priced are the wrappers apply installs (counted on the model)."""
    from autoprec.apply.apply import apply_policy
    from tests.zoo import mlp

    case = mlp()
    with apply_policy(case.model, pol, target="cpu"):
        installed = sum("forward" in m.__dict__ for m in case.model.modules())
    base = OpTimes(graph.batch_size, compute=timed.compute, other=timed.other,
                   casts=timed.casts, module_call_s=timed.module_call_s)
    with_wrappers = OpTimes(graph.batch_size, compute=timed.compute, other=timed.other,
                            casts=timed.casts, module_call_s=timed.module_call_s,
                            wrapper_s={"train": 1e-3, "deploy": 2e-3})
    prof = get_profile("cpu")
    plain = make_cost_model(graph, prof, graph.batch_size, op_times=base)
    wrapped = make_cost_model(graph, prof, graph.batch_size, op_times=with_wrappers)
    extra = wrapped.breakdown(pol).total_s - plain.breakdown(pol).total_s
    assert installed >= 2 if pol.layers else installed == 1
    assert extra == pytest.approx(installed * {"train": 1e-3, "deploy": 2e-3}[form], rel=1e-9)
    # the fp32 reference is the training form's fp32 (root wrapper, 1 ms) in every form
    assert wrapped.fp32_time - plain.fp32_time == pytest.approx(1e-3, rel=1e-9)
    assert set(timed.wrapper_s) == {"train", "deploy"}
    assert all(0 < s < 1e-3 for s in timed.wrapper_s.values())


def test_the_footprint_counts_parameters_and_each_kernels_output_once(graph) -> None:  # noqa: ANN001
    """Between two reads of a weight a forward moves every parameter and every op's output
    (a view moves nothing); activations grow with the timed batch."""
    from autoprec.measure.ops import _footprint

    vals = graph.ops.values
    params = sum(v.numel for v in vals if v.source == "param")
    outs = [(vals[o].numel, vals[o].scales) for op in graph.ops.ops if op.kind != "view"
            for o in op.outputs]
    assert _footprint(graph.ops, 1.0) == 4 * (params + sum(n for n, _ in outs))
    assert _footprint(graph.ops, 3.0) == 4 * (params + sum(n * (3 if s else 1) for n, s in outs))
    assert any(s for _, s in outs) and params > 0


def test_weight_casts_are_cycled_only_where_the_footprint_overflows_l2(graph, monkeypatch
                                                                       ) -> None:  # noqa: ANN001
    from autoprec.measure import op_runner
    from autoprec.measure import ops as op_measure

    with one_torch_thread():
        monkeypatch.setattr(op_runner, "_cache_bytes", lambda: {2: 1 << 30})
        hot = op_measure._cast_times(graph.ops, 1.0)
        monkeypatch.setattr(op_runner, "_cache_bytes", lambda: {2: 1024})
        cycled = op_measure._cast_times(graph.ops, 1.0)
    w = next(v.numel for v in graph.ops.values if v.param == "fc1.weight")
    assert f"{w}:fp32>bf16" in hot and f"{w}:fp32>bf16:w" not in hot
    assert f"{w}:fp32>bf16:w" in cycled and all(s > 0 for s in cycled.values())
