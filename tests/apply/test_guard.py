"""A deployed plan guards itself (apply.guard): examples/mixed8 under its guarded plan
(examples/mixed8/guarded.yaml: the h100 plan with wide1 / wide2 in fp16), fed inputs
scaled 3e4x so that wide1's fp16 overflows.

Unguarded the output is not finite; ``detect`` counts it by layer and warns once;
``fallback`` returns exactly what the plan with wide1 raised to bf16 computes (and counts
one fallback); ``raise`` gives one GuardError naming wide1 and the value; a compiled
guarded model detects too; calibration-sized inputs pass untouched.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from autoprec.apply.apply import ApplyOptions, apply_policy
from autoprec.errors import GuardError, GuardWarning, InputError, PolicyError
from autoprec.policy import Policy, load_policy, loads_policy
from autoprec.policy.guard_spec import GuardSpec
from autoprec.workload.loading import load_model_file
from tests.helpers import ROOT

SPEC = load_model_file(ROOT / "examples" / "mixed8" / "model.py")
POLICY = ROOT / "examples" / "mixed8" / "guarded.yaml"
SCALE = 3e4  # wide1's input reaches ~7.7e4 > 65504 (fp16's max)


def _x() -> torch.Tensor:
    return SPEC.calibration_batches()[0]  # (64, 64)


def _raised(policy: Policy, **layers: str) -> Policy:
    """The plan with ``layers`` raised, applied directly (no guard)."""
    return Policy(default=policy.default, layers={**policy.layers, **layers}, form="deploy",
                  model=policy.model, target=policy.target)


@pytest.fixture
def net() -> torch.nn.Module:
    return SPEC.model()


def test_unguarded_output_is_not_finite_and_calibration_inputs_are(net: torch.nn.Module
                                                                    ) -> None:
    pol = load_policy(POLICY, model=net)
    with torch.no_grad(), apply_policy(net, pol, guard="off") as h:
        assert h.guard is None and h.guard_stats() == {}
        assert torch.isfinite(net(_x())).all()
        assert not torch.isfinite(net(_x() * SCALE)).all()


def test_detect_counts_the_layer_and_warns_once(net: torch.nn.Module) -> None:
    pol = load_policy(POLICY, model=net)
    events = []
    with torch.no_grad(), apply_policy(net, pol, guard="detect",
                                             options=ApplyOptions(on_event=events.append)) as h:
        assert [g.path for g in h.guard.layers] == ["wide1", "wide2", "tail1", "tail2"]
        net(_x())
        with pytest.warns(GuardWarning, match="layer 'wide1' \\(fp16\\)"):
            y = net(_x() * SCALE)
        with warnings.catch_warnings():
            warnings.simplefilter("error", GuardWarning)  # once per layer: no second warning
            net(_x() * SCALE)
        stats = h.guard_stats()
    assert not torch.isfinite(y).all()  # detect returns the output as it is
    assert stats["wide1"].checks == 3 and stats["wide1"].overflows == 2
    assert stats["wide1"].fallbacks == 0
    assert events[0].layer == "wide1" and events[0].action == "detected"


def test_fallback_returns_the_raised_plans_output(net: torch.nn.Module) -> None:
    pol = load_policy(POLICY, model=net)  # guard: fallback
    x = _x() * SCALE
    with torch.no_grad(), apply_policy(net, _raised(pol, wide1="bf16")):
        want = net(x)
    assert torch.isfinite(want).all()
    with torch.no_grad(), apply_policy(net, pol) as h:
        assert h.guard is not None and h.guard.mode == "fallback"
        with pytest.warns(GuardWarning, match="re-ran with 'wide1' in bf16"):
            got = net(x)
        stats = h.guard_stats()
    assert torch.equal(got, want)
    assert stats["wide1"].fallbacks == 1 and stats["wide1"].overflows == 1
    assert stats["tail1"].fallbacks == 0  # flagged downstream of wide1, left as it was


def test_raise_names_the_layer_and_the_value(net: torch.nn.Module) -> None:
    pol = load_policy(POLICY, model=net)
    with torch.no_grad(), apply_policy(net, pol, guard="raise") as h:
        net(_x())
        with pytest.raises(GuardError) as err:
            net(_x() * SCALE)
    msg = str(err.value)
    assert "\n" not in msg and err.value.layer == "wide1"
    assert "layer 'wide1' (fp16)" in msg and "> 65504, the fp16 maximum" in msg
    assert h.guard_stats()["wide1"].overflows == 1


def test_compiled_guarded_model_runs_and_detects(net: torch.nn.Module) -> None:
    pol = load_policy(POLICY, model=net)
    with torch.no_grad():
        ref = net(_x())  # fp32
    with torch.no_grad(), apply_policy(net, pol, guard="detect") as h:
        compiled = torch.compile(net)
        got = compiled(_x())  # inductor rounds otherwise than eager: within the budget
        assert float((got - ref).norm() / ref.norm()) < pol.metrics["budget"]
        with pytest.warns(GuardWarning, match="wide1"):
            y = compiled(_x() * SCALE)
        assert not torch.isfinite(y).all()
        assert h.guard_stats()["wide1"].overflows == 1


def test_guard_selects_small_range_layers_all_or_a_list(net: torch.nn.Module) -> None:
    pol = load_policy(POLICY, model=net)
    with apply_policy(net, pol, guard={"mode": "detect", "layers": "all"}) as h:
        assert len(h.guard.layers) == 8
    with apply_policy(net, pol, guard={"mode": "detect", "layers": ["head"],
                                       "fallback": {"head": "fp32"}}) as h:
        assert h.guard.fallback_layers() == {"head": "fp32"}
    with pytest.raises(PolicyError, match=r"guard.layers\[0\]: 'norm1' is not a GEMM layer"):
        apply_policy(net, pol, guard={"mode": "detect", "layers": ["norm1"]})
    with pytest.warns(UserWarning, match="no layer to check"):
        h = apply_policy(net, Policy(default="bf16", form="deploy"), guard="detect")
    h.remove()


def test_fallback_needs_the_deploy_form(net: torch.nn.Module) -> None:
    pol = load_policy(POLICY, model=net)
    with pytest.raises(InputError, match="needs the deploy form"):
        apply_policy(net, pol, form="train", guard="fallback")


def test_policy_key_round_trips_and_names_the_key() -> None:
    text = "autoprec_policy: 1\ndefault: fp16\nguard: {mode: raise, layers: [a, b]}\n"
    pol = loads_policy(text, "p.yaml")
    assert pol.guard == GuardSpec("raise", ("a", "b"))
    assert loads_policy(pol.dumps()).guard == pol.guard
    assert "guard: detect" in Policy(default="fp16", guard="detect").dumps()
    assert "guard" not in Policy(default="fp16").dumps()  # off: nothing written
    with pytest.raises(PolicyError, match=r"^p.yaml: guard.mode: must be one of off, detect"):
        loads_policy("autoprec_policy: 1\ndefault: fp16\nguard: sometimes\n", "p.yaml")
    with pytest.raises(PolicyError, match=r"guard.fallback\['a'\]: must be one of fp32"):
        loads_policy("autoprec_policy: 1\ndefault: fp16\nguard: {fallback: {a: fp8}}\n")
