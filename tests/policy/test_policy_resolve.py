"""Resolution (most specific path wins; fp8 reaches eligible leaves only; the compiled
plan decides, ``autoprec.plan``) and the checks of a policy against a model (paths,
fingerprint, fp8 eligibility, shared modules)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.errors import PolicyError
from autoprec.plan import assignment, resolve
from autoprec.policy import (
    FingerprintMismatch,
    Policy,
    PolicyWarning,
    gemm_leaf_paths,
    load_policy,
)
from autoprec.trace.graph import fingerprint

pytestmark = pytest.mark.filterwarnings("ignore:.*structure is not checked:autoprec.policy.PolicyWarning")


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32)  # fp8-eligible
        self.odd = nn.Linear(32, 10)  # out_features 10: not fp8-eligible
        self.norm = nn.LayerNorm(32)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList([Inner(), Inner()])
        self.conv = nn.Conv1d(4, 4, 3)
        self.head = nn.Linear(32, 16)


def _prec(policy: Policy, model: nn.Module) -> dict[str, str]:
    return {p: r.precision for p, r in resolve(policy, model).items()}


def test_most_specific_path_wins() -> None:
    m = Model()
    pol = Policy(default="fp32", layers={"enc": "bf16", "enc.1": "fp16", "enc.1.q": "tf32"})
    got = _prec(pol, m)
    assert got["enc.0.q"] == "bf16" and got["enc.0.norm"] == "bf16"
    assert got["enc.1.odd"] == "fp16" and got["enc.1.q"] == "tf32"
    assert got["head"] == "fp32" and got[""] == "fp32"
    r = resolve(pol, m)
    assert r["enc.1.odd"].rule == "enc.1" and r["head"].rule is None
    assert r["head"].rule_label == "<default>"


def test_fp8_container_reaches_eligible_leaves_only() -> None:
    m = Model()
    pol = Policy(default="fp16", layers={"enc": "bf16", "enc.0": "fp8"})
    r = resolve(pol, m)
    assert (r["enc.0.q"].precision, r["enc.0.q"].region, r["enc.0.q"].rule) == (
        "fp8", "bf16", "enc.0")
    # everything else inside takes the nearest enclosing non-fp8 rule
    assert (r["enc.0.odd"].precision, r["enc.0.odd"].rule) == ("bf16", "enc")
    assert r["enc.0.norm"].precision == r["enc.0"].precision == "bf16"
    assert r["enc.1.q"].precision == "bf16"
    # ... or the default when none encloses it
    pol = Policy(default="fp16", layers={"": "fp8", "enc.1": "fp32"})
    got = _prec(pol, m)
    assert got["enc.0.q"] == "fp8" and got["head"] == "fp8" and got["enc.0.odd"] == "fp16"
    assert got["conv"] == "fp16" and got["enc.1.q"] == "fp32"  # more specific wins over fp8


def test_assignment_of_gemm_leaves() -> None:
    m = Model()
    assert gemm_leaf_paths(m) == ["enc.0.q", "enc.0.odd", "enc.1.q", "enc.1.odd", "conv",
                                  "head"]
    pol = Policy(default="bf16", layers={"enc": "fp8", "head": "fp32"})
    assert assignment(pol, m) == {"enc.0.q": "fp8", "enc.0.odd": "bf16", "enc.1.q": "fp8",
                                  "enc.1.odd": "bf16", "conv": "bf16", "head": "fp32"}
    # a cost model may ask for its own GEMM nodes (e.g. an attention module)
    assert assignment(pol, m, paths=["enc.0", "_orig_mod.head"]) == {"enc.0": "bf16",
                                                                     "head": "fp32"}
    with pytest.raises(PolicyError, match="no module 'nope'"):
        assignment(pol, m, paths=["nope"])


@pytest.mark.parametrize("layers, locked, match", [
    ({"enc.2.q": "bf16"}, [], r"p.yaml: layers\['enc.2.q'\]: the model has no module "
                              r"'enc.2.q' \(did you mean 'enc.1.q'\?\)"),
    ({}, ["encoder"], r"p.yaml: locked\[0\]: the model has no module 'encoder'"),
    ({"enc.0.odd": "fp8"}, [], r"p.yaml: layers\['enc.0.odd'\]: fp8 rule on an ineligible "
                               r"layer: fp8: out_features 10 not a multiple of 16"),
    ({"enc.0.norm": "fp8"}, [], r"layers\['enc.0.norm'\]: fp8 rule on an ineligible layer: "
                                r"fp8: LayerNorm is not a Linear-like GEMM"),
    ({"conv": "fp8"}, [], r"layers\['conv'\]: fp8 rule on an ineligible layer: fp8: Conv1d"),
])
def test_model_checks_name_the_problem(tmp_path: Path, layers, locked, match) -> None:
    path = tmp_path / "p.yaml"
    Policy(layers=layers, locked=locked).save(path)
    with pytest.raises(PolicyError, match=match):
        load_policy(path, model=Model())


def test_fingerprint_mismatch_refused_unless_forced(tmp_path: Path) -> None:
    m = Model()
    other = Model()
    other.head = nn.Linear(32, 48)  # a parameter shape changed
    path = tmp_path / "p.yaml"
    Policy(layers={"head": "bf16"}, model={"fingerprint": fingerprint(other)}).save(path)
    with pytest.raises(FingerprintMismatch, match=r"p.yaml: model.fingerprint: sha256:\w+… "
                                                  r"does not match the model") as err:
        load_policy(path, model=m)
    assert err.value.exit_code == 2 and "--force" in str(err.value)
    with pytest.warns(PolicyWarning, match="applied anyway"):
        load_policy(path, model=m, force=True)


def test_fingerprint_missing_warns_and_matching_is_silent(tmp_path: Path) -> None:
    m = Model()
    path = tmp_path / "p.yaml"
    Policy(layers={"head": "bf16"}).save(path)
    with pytest.warns(PolicyWarning, match="model.fingerprint: missing"):
        load_policy(path, model=m)
    Policy(layers={"head": "bf16"}, model={"fingerprint": fingerprint(m)}).save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_policy(path, model=m).layers == {"head": "bf16"}


def test_compiled_and_wrapped_models_match_plain_paths() -> None:
    m = Model()
    compiled = torch.compile(m, backend="eager")  # paths gain `_orig_mod.`
    pol = Policy(layers={"_orig_mod.enc.0": "bf16"}, model={"fingerprint": fingerprint(m)})
    pol.validate(compiled)
    assert _prec(pol, compiled)["enc.0.q"] == "bf16"


def test_fp8_container_without_eligible_leaves_warns() -> None:
    """The applied plan says so: the rule decides no module."""
    m = Model()
    m.enc[0].q = nn.Linear(32, 24)  # now nothing in enc.0 is fp8-eligible
    with pytest.warns(PolicyWarning, match=r"layers\['enc.0'\]: the fp8 rule reaches no "
                                           r"fp8-eligible Linear layer.*takes fp16"):
        apply_policy(m, Policy(default="fp16", layers={"enc.0": "fp8"})).remove()
    # enc.1.q is eligible, but a more specific rule covers it
    with pytest.warns(PolicyWarning, match=r"layers\['enc.1'\]: the fp8 rule reaches no "
                                           r"fp8-eligible Linear layer.*takes bf16"):
        apply_policy(m, Policy(default="bf16", layers={"enc.1": "fp8", "enc.1.q": "fp16"})
                     ).remove()


def test_shared_module_must_get_one_precision() -> None:
    """One module object, one precision: a rule on any of its paths is a rule on the module
    (``self.mid2 = self.mid``, a real pattern, must tune); two rules naming it must agree."""
    m = Model()
    m.alias = m.enc[0]  # the same module under a second path
    Policy(layers={"enc.0": "bf16", "alias": "bf16"}).validate(m)
    Policy(layers={"enc.0": "bf16"}).validate(m)  # the alias follows the module's rule
    res = resolve(Policy(layers={"alias": "bf16"}), m)
    assert res["enc.0"].precision == res["alias"].precision == "bf16"
    assert res["alias.q"].precision == res["enc.0.q"].precision == "bf16"
    with pytest.raises(PolicyError, match=r"module 'enc.0' is also registered as "
                                          r"'alias'.*bf16 there and fp32 here"):
        Policy(layers={"enc.0": "bf16", "alias": "fp32"}).validate(m)
    with pytest.raises(PolicyError, match=r"module 'enc.0.q' is also registered as "
                                          r"'alias.q'.*bf16 there and fp16 here"):
        Policy(layers={"enc.0.q": "bf16", "alias.q": "fp16"}).validate(m)
