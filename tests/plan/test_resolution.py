"""The compiled plan is the one resolver: its resolution of every module path equals the
rules as docs/overview.md states them (most specific path wins, formats only on eligible leaves,
a shared module one precision under every alias), walked here path by path as the
reference, on every zoo model."""

from __future__ import annotations

import pytest
from torch import nn

from autoprec.formats.precisions import GEMM_FORMATS
from autoprec.plan import compile_plan, resolve, resolve_path
from autoprec.policy import Policy, Resolved
from autoprec.policy.modules import format_eligible
from tests import zoo
from tests.apply.test_every_rule_runs import _mixed_policy

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


def _by_the_rules(policy: Policy, model: nn.Module) -> dict[str, Resolved]:
    """The reference: for each module, walk from its (first) path up to the root; the
    first rule found decides a format where the module is eligible for it, else the
    nearest non-format rule (or the default) gives its region and precision."""
    first = {id(m): p for p, m in model.named_modules()}
    table = dict(model.named_modules(remove_duplicate=False))
    rules = {first[id(table[p])]: prec for p, prec in policy.layers.items()}
    out = {}
    for path, m in table.items():
        anc, found, region, region_rule = first[id(m)], None, policy.default, None
        while True:
            prec = rules.get(anc)
            if prec is not None:
                found = found or (anc, prec)
                if prec not in GEMM_FORMATS:
                    region, region_rule = prec, anc
                    break
            if not anc:
                break
            anc = anc.rpartition(".")[0]
        if found is not None and found[1] in GEMM_FORMATS and format_eligible(m, found[1]):
            out[path] = Resolved(path, found[1], region, found[0])
        else:
            out[path] = Resolved(path, region, region, region_rule)
    return out


@pytest.mark.parametrize("name", ["mlp", "shared", "cnn", "nn_encoder", "mha", "bert", "gpt2"])
def test_plan_resolution_equals_the_rules(name: str) -> None:
    model = zoo.ALL[name]().model
    containers = [p for p, m in model.named_modules() if p and next(m.children(), None)]
    policies = [
        _mixed_policy(model),
        Policy(default="fp16"),
        Policy(default="bf16", layers={p: "fp32" for p in containers[:2]}),
        Policy(default="fp32", layers={p: "fp8" for p in containers[:1]}),
    ]
    for pol in policies:
        assert compile_plan(pol, model).resolution() == _by_the_rules(pol, model)


class _Aliased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24))  # [1]: not fp8-able
        self.alias = self.enc  # the same module under a second path
        self.head = nn.Linear(32, 16)


@pytest.mark.parametrize("layers", [
    {"alias": "bf16"},
    {"alias": "fp8", "enc.1": "fp16"},
    {"": "fp8", "alias.0": "fp16"},
    {"enc": "fp16", "alias.0": "fp8", "head": "tf32"},
])
def test_a_rule_on_an_alias_is_a_rule_on_the_module(layers: dict[str, str]) -> None:
    """The deciding rule is named by the module's first path, under every alias."""
    model, pol = _Aliased(), Policy(default="bf16", layers=layers)
    assert compile_plan(pol, model).resolution() == _by_the_rules(pol, model) == resolve(
        pol, model)


def test_resolve_path_needs_no_model() -> None:
    """One path and its module: the rules on the path's ancestors decide, as in the plan."""
    model = _Aliased()
    pol = Policy(default="bf16", layers={"": "fp8", "enc": "fp16", "head": "fp32"})
    res = compile_plan(pol, model).resolution()
    for path in ("", "enc", "enc.0", "enc.1", "head"):
        assert resolve_path(pol, path, model.get_submodule(path)) == res[path]
    assert resolve_path(pol, "x.y", nn.Linear(32, 32)) == Resolved("x.y", "fp8", "bf16", "")


def test_a_rule_on_a_path_the_model_lacks_is_a_policy_error_naming_it():
    from autoprec.errors import PolicyError
    from autoprec.plan import assignment

    net = nn.Sequential(nn.Linear(4, 4))
    pol = Policy(default="fp32", layers={"7": "bf16"})
    for fn in (resolve, assignment):
        with pytest.raises(PolicyError, match=r"layers\['7'\]: the model has no such module"):
            fn(pol, net)
