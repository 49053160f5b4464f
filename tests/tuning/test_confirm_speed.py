"""tune's last step (issue 21): the winner timed beside its baselines; a plan measured
slower than fp32 or a one-liner within budget is never written.

The decision is tested with injected timings (no wall-clock assertions); one end-to-end
tune on a tiny MLP for ``--target cpu`` swaps the timer for one that makes the tuned plan
slow, and must write the baseline instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import autoprec.evaluation.rows as rows_mod
import autoprec.evaluation.timing as timing
from autoprec.evaluation.decision import fastest_measured
from autoprec.evaluation.rows import Row, label
from autoprec.policy import Policy, load_policy
from autoprec.tuning.tune import tune
from tests.helpers import MODELS, check_speed

MLP = MODELS / "mlp.py"


def rows(tuned_ok: bool = True, bf16_ok: bool = True) -> list[Row]:
    return [
        Row("tuned", "tuned", Policy(default="fp32", layers={"0": "bf16"}), 0.01, tuned_ok,
            1.8),
        Row("next candidate (trial 3)", "candidate", Policy(default="fp32", layers={"2": "bf16"}),
            0.005, True, 1.4),
        Row(label("fp32"), "baseline", Policy(default="fp32"), 0.0, True, 1.0),
        Row(label("bf16"), "baseline", Policy(default="bf16"), 0.02 if bf16_ok else 0.2,
            bf16_ok, 1.9, why_not="" if bf16_ok else "over budget (0.2 > 0.03)"),
        Row(label("tf32"), "baseline", None, why_not="not on cpu"),
    ]


def timer_of(ms: Mapping[str, float], rounds: int = 5):
    """A timer returning fixed per-round seconds (a little jitter, the same every run)."""
    seen: list[list[str]] = []

    def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
        seen.append(list(plans))
        return {n: [ms[n] * 1e-3 * (1 + 0.01 * ((i % 3) - 1)) for i in range(rounds)]
                for n in plans}

    timer.seen = seen  # type: ignore[attr-defined]
    return timer


def test_a_tuned_plan_measured_slower_than_fp32_is_not_written():
    rs = rows(bf16_ok=False)
    t = timer_of({"tuned": 60, "next candidate (trial 3)": 40, label("fp32"): 34,
                  label("bf16"): 20})
    check = check_speed(rs, t, device="cpu", batch_size=16)
    assert check.winner is not None and check.winner.name == label("fp32")
    assert "tuned (est. 1.80x) measured 0.57x" in check.reason
    assert "slower than fp32" in check.reason
    tuned = rs[0]
    assert tuned.speedup == pytest.approx(34 / 60, rel=1e-6)
    assert tuned.p10 <= tuned.speedup <= tuned.p90
    # the over-budget bf16 one-liner is timed and shown, never chosen
    assert rs[3].speedup == pytest.approx(34 / 20, rel=1e-6) and not rs[3].feasible
    assert label("tf32") not in t.seen[0]  # the target cannot run it: not timed
    assert "fp32" in check.recommendation()


def test_the_next_candidate_is_written_when_it_beats_the_tuned_one_and_every_baseline():
    rs = rows()
    t = timer_of({"tuned": 40, "next candidate (trial 3)": 25, label("fp32"): 34,
                  label("bf16"): 30})
    winner, why, _runner = fastest_measured(_filled(rs, t))
    assert winner is rs[1]
    assert why.winner.name == "next candidate (trial 3)"  # type: ignore[attr-defined]


def test_a_faster_one_liner_within_budget_wins_over_the_tuned_plan():
    rs = rows()
    t = timer_of({"tuned": 30, "next candidate (trial 3)": 32, label("fp32"): 34,
                  label("bf16"): 20})
    check = check_speed(rs, t, device="cpu", batch_size=16)
    assert check.winner is rs[3]
    assert "one global autocast" in check.recommendation()


def test_the_tuned_plan_stands_when_it_is_the_fastest_and_ties_keep_it():
    rs = rows()
    t = timer_of({"tuned": 20, "next candidate (trial 3)": 20, label("fp32"): 34,
                  label("bf16"): 30})
    check = check_speed(rs, t, device="cpu", batch_size=16)
    assert check.winner is rs[0]  # the candidate ties it with as many rules: tuned kept
    assert check.to_dict()["chosen"] == "tuned"
    assert "<- written" in check.table().splitlines()[2]


def test_a_near_tie_writes_the_simpler_plan_and_says_so():
    """Within the noise (p10-p90 ranges overlap) the plan with fewer rules is written: a
    one-liner over a tuned plan of one rule; a clear win keeps the tuned plan."""
    def noisy(ms: Mapping[str, float]):
        def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
            # each plan its own jitter (+-3 %, out of phase): the ratios spread per round
            return {n: [ms[n] * 1e-3 * (1 + 0.03 * (((i + k) % 3) - 1)) for i in range(5)]
                    for k, n in enumerate(plans)}
        return timer

    rs = rows()
    t = noisy({"tuned": 20, "next candidate (trial 3)": 25, label("fp32"): 34,
               label("bf16"): 20.1})
    check = check_speed(rs, t, device="cpu", batch_size=16)
    assert check.winner is rs[3]
    assert "as fast within the noise, the simpler plan is written" in check.reason
    assert "(0 rules)" in check.reason and "tuned (1 rules)" in check.reason
    rs = rows()
    t = noisy({"tuned": 20, "next candidate (trial 3)": 25, label("fp32"): 34,
               label("bf16"): 24})
    assert check_speed(rs, t, device="cpu", batch_size=16).winner is rs[0]


def test_a_timed_row_that_page_faults_in_every_forward_is_named_in_the_reason():
    """Fresh memory in every forward (glibc returning a large per-call buffer to the OS)
    makes a row's time depend on the process: the reason names it, the report keeps it."""
    from autoprec.measure.latency import Samples

    base = timer_of({"tuned": 40, "next candidate (trial 3)": 45, label("fp32"): 34,
                     label("bf16"): 30})

    def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
        got = Samples(base(plans))
        got.faults = {n: [15000.0 if n == label("bf16") else 3.0] * 5 for n in plans}
        return got

    rs = rows()
    check = check_speed(rs, timer, device="cpu", batch_size=16)
    assert f"page faults per timed call (a forward, or a training step): {label('bf16')} 15,000." in check.reason
    assert rs[3].faults == 15000 and rs[2].faults == 3
    assert rs[3].to_dict()["page_faults_per_forward"] == 15000
    assert "page faults" not in check_speed(rows(), base, device="cpu", batch_size=16).reason


def test_a_plan_casting_per_call_is_written_only_if_it_still_wins_with_a_cold_allocator():
    """The training form's per-call casts fault on fresh pages in one process and not in
    another: before such a plan is written it is timed again with the allocator trimmed
    before every forward, and each row keeps its slower state."""
    from autoprec.evaluation.timing import cold_confirm

    def rows_ac() -> list[Row]:
        return [
            Row("tuned", "tuned", Policy(default="bf16", form="train"), 0.01, True, 2.4),
            Row(label("fp32"), "baseline", Policy(default="fp32"), 0.0, True, 1.0),
            Row(label("bf16"), "baseline", Policy(default="bf16", form="deploy"), 0.01, True,
                2.2),
        ]

    warm = timer_of({"tuned": 20, label("fp32"): 50, label("bf16"): 25})
    cold = timer_of({"tuned": 45, label("fp32"): 50, label("bf16"): 25})
    rs = rows_ac()
    check = check_speed(rs, warm, device="cpu", batch_size=16, cold_timer=cold)
    assert check.winner is not None and check.winner.name == label("bf16")
    assert "tuned casts its weights on every call" in check.reason
    assert "tuned 2.50x -> 1.11x" in check.reason
    assert cold.seen == [["tuned", label("fp32"), label("bf16")]]  # the winner and the rest
    assert rs[0].warm is not None and rs[0].warm[0] == pytest.approx(2.5, rel=1e-6)
    assert rs[0].to_dict()["measured_before_cold_confirm"] == pytest.approx(2.5, rel=1e-3)
    assert rs[2].warm is None  # the deploy form is as fast cold: its first timing stands
    # still the fastest cold: written, and the reason says it was checked
    rs = rows_ac()
    check = check_speed(rs, warm, device="cpu", batch_size=16, cold_timer=warm)
    assert check.winner is rs[0] and "none slower" in check.reason
    # a deploy-form winner holds its weights once: no second timing
    quiet = timer_of({"tuned": 60, label("fp32"): 50, label("bf16"): 25})
    rs = rows_ac()
    check = check_speed(rs, quiet, device="cpu", batch_size=16, cold_timer=cold)
    assert check.winner is rs[2] and len(cold.seen) == 1
    assert cold_confirm(rs, rs[2], cold) is None


def test_the_same_plan_is_timed_once():
    rs = rows()
    rs[3] = Row(label("bf16"), "baseline", Policy(default="fp32", layers={"0": "bf16"}), 0.01,
                True, 1.8)
    t = timer_of({"tuned": 20, "next candidate (trial 3)": 30, label("fp32"): 34})
    check_speed(rs, t, device="cpu", batch_size=16)
    assert label("bf16") not in t.seen[0] and rs[3].same_as == "tuned"
    assert rs[3].speedup == rs[0].speedup


def test_a_remote_target_stays_estimated():
    rs = rows()
    check = check_speed(rs, None)
    assert not check.measured and check.winner is rs[0]
    assert all(r.speedup is None for r in rs)
    assert "not measured" in check.table()
    assert "estimated" in check.recommendation()


def _filled(rs: list[Row], timer) -> list[Row]:
    plans = {r.name: r.policy for r in rs if r.policy is not None}
    rows_mod.fill_measured(rs, timer(plans))
    return rs


def test_tune_for_the_local_cpu_writes_the_baseline_when_the_tuned_plan_measures_slower(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """End to end: the CPU target is calibrated here (cached), and a timer that makes the
    tuned plan slower than a baseline makes tune write that baseline. Which plan the search
    picks depends on this CPU (bf16 pays with AMX, not without), so the timer slows
    whichever the tuned plan is: a lowered tuned plan measures slower than fp32 (fp32 is
    written); an fp32 one slower than the bf16 one-liners (one global autocast, or
    ``model.to(bfloat16)`` where the autocast is estimated too slow here to be timed: one
    of them is written)."""

    def fp32(p: Policy) -> bool:
        return p.default == "fp32" and not p.layers

    def slower_tuned(model, run, device, target, **kw):
        seen: dict[str, bool] = {}

        def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
            # the first call times every row; a re-timing (the estimate contradicted) only
            # the contradicted pair and fp32, without the tuned row
            if "lowered" not in seen:
                seen["lowered"] = not fp32(plans["tuned"])
            lowered = seen["lowered"]
            if lowered:
                return {n: [0.010 if fp32(p) else 0.020] * 3 for n, p in plans.items()}
            return {n: [0.005 if (p.default == "bf16" and not p.layers) else 0.020] * 3
                    for n, p in plans.items()}
        return timer

    monkeypatch.setattr(timing, "interleaved_timer", slower_tuned)
    out = tmp_path / "p.yaml"
    res = tune(MLP, max_error=0.05, target="cpu", precisions=["bf16"], trials=5,
               batch_size=65536, out=out, progress=False)
    assert res.plan.speed is not None
    tuned = res.plan.speed.rows[0].policy
    pol = load_policy(out)
    if tuned.default != "fp32" or tuned.layers:
        assert pol.default == "fp32" and pol.layers == {}
        assert pol.metrics["measured_speedup"] == pytest.approx(1.0)
    else:
        assert (pol.default, pol.layers) == ("bf16", {})
        assert pol.metrics["measured_speedup"] == pytest.approx(4.0)
    assert "batch size 2" in pol.metrics["measured_on"]
    assert pol.provenance["speed_source"] == "calibrated here"
    assert "avx" in pol.provenance["machine"] or "torch" in pol.provenance["machine"]
    assert res.plan.speed is not None and res.plan.speed.winner.role == "baseline"
    assert any("calibrated the cpu profile on this machine" in n for n in res.plan.notes)
    assert any("priced with this model's ops" in n for n in res.plan.notes)
    # a second tune reads this machine's calibration from the cache
    res2 = tune(MLP, max_error=0.05, target="cpu", precisions=["bf16"], trials=5,
                batch_size=65536, out=tmp_path / "q.yaml", progress=False)
    assert load_policy(tmp_path / "q.yaml").provenance["speed_source"] == "cached calibration"
    assert any("cached in" in n for n in res2.plan.notes)


def test_a_train_form_tune_never_writes_the_stored_16_bit_one_liner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``--form train`` asks for autocast over fp32 masters: ``model.to(bf16)`` is timed and
    shown beside the plan, but it stores no masters to train, so it is never written, even
    measured fastest (seen on examples/wide: written as the answer to --form train)."""

    def deploy_fastest(model, run, device, target, **kw):
        def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
            return {n: [0.002 if p.form == "deploy" and p.default == "bf16" else
                        0.010 if p.default == "fp32" and not p.layers else 0.008] * 3
                    for n, p in plans.items()}
        return timer

    monkeypatch.setattr(timing, "interleaved_timer", deploy_fastest)
    out = tmp_path / "p.yaml"
    res = tune(MLP, max_error=0.05, target="cpu", precisions=["bf16"], trials=3,
               form="train", out=out, progress=False)
    assert res.plan.speed is not None and res.plan.speed.winner is not None
    stored = next(r for r in res.plan.speed.rows if r.name == label("bf16", "deploy"))
    assert stored.speedup == pytest.approx(5.0) and not stored.feasible
    assert stored.why_not == "--form train: it stores no fp32 masters"
    assert load_policy(out).form == "train"


def test_tune_for_a_remote_target_says_it_is_estimated(tmp_path: Path):
    res = tune(MLP, max_error=0.05, target="h100", precisions=["bf16"], trials=3,
               out=tmp_path / "p.yaml", progress=False)
    assert res.plan.speed is not None and not res.plan.speed.measured
    assert "no h100 here" in res.plan.speed.reason
    names = [r.name for r in res.plan.speed.rows]
    assert names[0] == "tuned" and label("fp32") in names and label("tf32") in names
    pol = load_policy(tmp_path / "p.yaml")
    assert pol.provenance["speed_source"] == "stored profile"
    assert "measured_speedup" not in pol.metrics


def _local_gpu_profile() -> str | None:
    import torch

    from autoprec.cost import get_profile, known_devices
    from autoprec.measure.machine import local_device

    if not torch.cuda.is_available():
        return None
    return next((d for d in known_devices() if d != "cpu"
                 and local_device(get_profile(d))[0] is not None), None)


@pytest.mark.gpu
@pytest.mark.skipif(_local_gpu_profile() is None,
                    reason="no CUDA device here that a device profile names")
def test_tune_for_the_gpu_at_hand_calibrates_and_times_with_cuda_events(tmp_path: Path):
    target = _local_gpu_profile()
    res = tune(MLP, max_error=0.05, target=target, precisions=["bf16", "fp16"], trials=3,
               batch_size=4096, out=tmp_path / "p.yaml", progress=False)
    assert res.plan.speed is not None and res.plan.speed.measured
    assert res.plan.speed.device.startswith("cuda") and "CUDA events" in res.plan.speed.how
    pol = load_policy(tmp_path / "p.yaml")
    assert pol.provenance["speed_source"] == "calibrated here"
    assert pol.metrics["measured_speedup"] > 0


@pytest.mark.slow
def test_the_compiled_timer_times_each_plan_on_its_own_compiled_copy():
    """Each plan: a copy of the model, the plan applied, compiled once before the rounds;
    the model handed in is left as it was (no policy, no compiled state)."""
    import torch
    from torch._dynamo.utils import counters

    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
                              torch.nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16)
    before = net(x)
    timer = timing.compiled_timer(net, lambda m, b: m(b), x, "cpu", "cpu")
    counters.clear()
    samples = timer({"fp32": Policy(default="fp32"),
                     "bf16": Policy(default="fp32", layers={"2": "bf16"})})
    assert set(samples) == {"fp32", "bf16"}
    assert all(len(v) >= timing.MIN_ROUNDS and min(v) > 0 for v in samples.values())
    assert counters["stats"]["unique_graphs"] >= 2  # one compiled program per plan
    assert not net._forward_hooks and not net._forward_pre_hooks
    assert torch.equal(net(x), before)


@pytest.mark.slow
def test_tune_for_a_compiled_cpu_deployment_times_its_plans_compiled(tmp_path: Path):
    """``--compile --target cpu``: priced on this machine's compiled calibration (seeded
    in the cache here, so the test does not spend minutes calibrating), and the rows
    timed compiled."""
    from autoprec.cost import Calibration, get_profile
    from autoprec.measure.machine import calibration_path, this_machine

    m = this_machine("cpu")
    Calibration(device="cpu", efficiency={"fp32": 0.5, "bf16": 0.5}, machine=m.to_dict(),
                mode="compile", call_overhead_s=50e-6).save(calibration_path(
                    tmp_path / ".autoprec" / "calibration", get_profile("cpu"), m, "compile"))
    out = tmp_path / "p.yaml"
    res = tune(MLP, max_error=0.05, target="cpu", precisions=["bf16"], trials=3,
               out=out, progress=False, compile=True)
    assert res.plan.speed is not None and res.plan.speed.measured
    assert "torch.compile'd" in res.plan.speed.how
    pol = load_policy(out)
    assert pol.target["mode"] == "compile"
    assert pol.provenance["speed_source"] == "cached calibration"
    assert "torch.compile'd" in pol.metrics["measured_on"]
    timed = [r for r in res.plan.speed.rows if r.speedup is not None]
    assert {r.name for r in timed} >= {"tuned", label("fp32"), label("bf16")}


def test_of_two_one_liners_as_fast_the_one_holding_less_memory_is_written():
    def noisy(ms: Mapping[str, float]):
        def timer(plans: Mapping[str, Policy]) -> Mapping[str, Sequence[float]]:
            return {n: [ms[n] * 1e-3 * (1 + 0.03 * (((i + k) % 3) - 1)) for i in range(5)]
                    for k, n in enumerate(plans)}
        return timer

    autocast = Row(label("bf16"), "baseline", Policy(default="bf16"), 0.01, True, 2.0,
                   weight_bytes=90)
    deployed = Row(label("bf16", "deploy"), "baseline", Policy(default="bf16", form="deploy"),
                   0.01, True, 2.0, weight_bytes=45)
    rs = [Row("tuned", "tuned", Policy(default="fp32", layers={"0": "bf16"}), 0.01, True, 1.5),
          Row(label("fp32"), "baseline", Policy(default="fp32"), 0.0, True, 1.0), autocast,
          deployed]
    t = noisy({"tuned": 30, label("fp32"): 34, label("bf16"): 19.5,
               label("bf16", "deploy"): 20.0})
    check = check_speed(rs, t, device="cpu", batch_size=16)
    assert check.winner is deployed
    autocast.weight_bytes, deployed.weight_bytes = 45, 90  # the memory decides, not the name
    for r in rs:
        r.same_as = None
    assert check_speed(rs, t, device="cpu", batch_size=16).winner is autocast


def test_with_no_trial_within_budget_the_fastest_baseline_within_budget_is_written():
    """A tuned plan over budget (or whose rule did not run) is not what is written when a
    one-liner meets the budget: the fastest such baseline is (by estimate, for a remote
    target); a baseline below ``--min-speedup`` is not a choice."""
    from autoprec.evaluation.decision import Fallback, Rule, Timing, decide

    def written(rs: list[Row]) -> Row | None:
        d = decide(rs, Timing(note="not measured"))
        instead = d.reason(Rule.ESTIMATED_INSTEAD)
        assert (instead is None) == (d.winner is rs[0])
        if instead is not None:
            assert instead.fallback is Fallback.BASELINE_WITHIN_BUDGET  # type: ignore[attr-defined]
        return None if d.winner is rs[0] else d.winner

    rs = rows(tuned_ok=False)
    got = written(rs)
    assert got is not None and got.name == label("bf16")  # 1.9x beats fp32's 1.0x
    assert written(rows(tuned_ok=True)) is None
    rs[3].feasible = False  # bf16 over budget: fp32 is the one within budget
    assert written(rs).name == label("fp32")
    rs[2].feasible = False  # nothing within budget: the closest plan stands
    assert written(rs) is None


def test_a_training_one_liner_estimated_under_half_fp32_is_neither_timed_nor_written():
    """On a CPU with no fp16 kernel, one global fp16 autocast is estimated ~0.35x and each of
    its timed steps costs a dozen fp32 steps: it is not timed, not written, and says why;
    fp32, the tuned plan, a fast one-liner and the deploy-form rows are timed as before."""
    from autoprec.evaluation.decision import SLOW_TO_TIME, rows_to_time

    rs = [Row("tuned", "tuned", Policy(default="fp32", layers={"a": "bf16"}, form="train"),
              0.001, True, 1.3),
          Row(label("fp32"), "baseline", Policy(default="fp32", form="train"), 0.0, True, 1.0),
          Row(label("bf16"), "baseline", Policy(default="bf16", form="train"), 0.008, True,
              1.35),
          Row(label("fp16"), "baseline", Policy(default="fp16", form="train"), 0.001, True,
              0.35),
          Row(label("bf16", "deploy"), "baseline", Policy(default="bf16", form="deploy"),
              0.01, False, 0.0, why_not="--form train: it stores no fp32 masters")]
    kept = rows_to_time(rs)
    assert [r.name for r in kept] == [rs[i].name for i in (0, 1, 2, 4)]
    assert not rs[3].feasible and rs[3].why_not == (
        f"not timed: estimated 0.35x, under {SLOW_TO_TIME:g}x of fp32's speed here")
    assert rs[2].feasible and rs[4].why_not.startswith("--form train")
