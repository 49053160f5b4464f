"""A policy written with one rule per GEMM layer and its compact form compile to the same
plan: the same replayed schedule, and bit-identical outputs when applied."""

from __future__ import annotations

import pytest
import torch

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.plan.schedule import signature
from autoprec.policy import Policy, gemm_leaf_paths
from autoprec.search.compaction import compact
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file
from tests import zoo
from tests.helpers import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
REGIONS = ("fp32", "tf32", "bf16", "fp16")


def _gemm_nodes(graph) -> list[str]:
    return [n.path for n in graph.gemm_nodes if n.is_leaf or n.kind in ("attention", "matmul")]


def _same_outputs(model, fwd, batch, a: Policy, b: Policy) -> bool:
    outs = []
    for pol in (a, b):
        with apply_policy(model, pol, target="h100"), torch.no_grad():
            out = fwd(model, batch)
        outs.append(out if isinstance(out, torch.Tensor) else out[0])
    return torch.equal(outs[0], outs[1])


def _check(model, fwd, batch, default: str, layers: dict[str, str], want_rules: int | None):
    graph = trace(model, batch, forward=fwd, tracers=("hooks",))
    cost = CostModel(graph, get_profile("h100"), batch_size=1024)
    new_default, rules = compact(cost, default, layers, defaults=REGIONS)
    assert len(rules) <= len(layers)
    if want_rules is not None:
        assert len(rules) == want_rules, rules
    assert signature(cost.schedule(rules, new_default)) == signature(
        cost.schedule(layers, default))
    assert _same_outputs(model, fwd, batch, Policy(default=default, layers=layers),
                         Policy(default=new_default, layers=rules))
    return new_default, rules


def test_a_block_that_shares_a_precision_gets_one_container_rule() -> None:
    spec = load_model_file(ROOT / "examples" / "wide" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    leaves = gemm_leaf_paths(model)
    layers = {k: ("fp8" if k.startswith("blocks.") else "fp16") for k in leaves}
    _, rules = _check(model, spec.forward, batch, "fp16", layers, want_rules=1)
    assert rules == {"blocks": "fp8"}
    mixed = {k: ("bf16" if k.startswith(("blocks.0.", "blocks.1.")) else "fp16")
             for k in leaves}
    _, rules = _check(model, spec.forward, batch, "fp16", mixed, want_rules=2)
    assert rules == {"blocks.0": "bf16", "blocks.1": "bf16"}


def test_uniform_per_layer_rules_become_the_default() -> None:
    case = zoo.ALL["bert"]()
    fwd = case.forward or (lambda m, b: m(**b))
    graph = trace(case.model, case.batch, forward=fwd, tracers=("hooks",))
    layers = dict.fromkeys(_gemm_nodes(graph), "fp16")
    default, rules = _check(case.model, fwd, case.batch, "fp16", layers, want_rules=0)
    assert default == "fp16"


def test_a_rule_that_changes_the_plan_is_kept() -> None:
    """Under a fp32 default a lowered leaf's output is cast back to fp32 for the model's own
    code; one container rule would run that code in 16-bit: a different plan, so the leaf
    rules stay."""
    spec = load_model_file(ROOT / "examples" / "mixed8" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    layers = dict.fromkeys(gemm_leaf_paths(model), "bf16")
    _check(model, spec.forward, batch, "fp32", layers, want_rules=len(layers))


def test_tf32_on_every_layer_but_the_head_reads_as_the_tf32_default() -> None:
    """`default: fp32` + a tf32 rule per Linear (all but the head) is the tf32 default with
    one exception: tf32 changes only matmuls, so the model's own code runs the same (a new
    user's h100 policy was 16 per-Linear tf32 rules, estimated equal to the tf32 flag)."""
    spec = load_model_file(ROOT / "examples" / "trap" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    layers = {k: "tf32" for k in gemm_leaf_paths(model) if k != "head"}
    default, rules = _check(model, spec.forward, batch, "fp32", layers, want_rules=1)
    assert (default, rules) == ("tf32", {"head": "fp32"})
    every = dict.fromkeys(gemm_leaf_paths(model), "tf32")
    assert _check(model, spec.forward, batch, "fp32", every, want_rules=0)[0] == "tf32"


def test_differences_names_the_outermost_module_in_another_precision() -> None:
    from autoprec.search.compaction import differences

    spec = load_model_file(ROOT / "examples" / "wide" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    graph = trace(model, batch, forward=spec.forward, tracers=("hooks",))
    cost = CostModel(graph, get_profile("h100"), batch_size=1024)
    diff = differences(cost, ("bf16", {"blocks.1": "fp32"}), ("bf16", {}))
    assert diff == [("blocks.1", "fp32", "bf16")]  # its children are not listed again
    assert differences(cost, ("bf16", {}), ("bf16", {})) == []
    assert differences(cost, ("fp32", {}), ("bf16", {}))[0] == ("", "fp32", "bf16")
