"""The apply tests tell one precision from another: each of their cases, with one rule run
in the wrong precision, fails their comparison.

Two ways to run a layer wrong:

- *policy*: apply a policy that gives one rule (or the default) another precision, and
  compare with the hand reference of the original policy — what an apply that lowered the
  wrong layer, or the right layer to the wrong format, would produce. Each precision is
  swapped for its nearest neighbour (the hardest to tell apart: tf32 <-> fp32, bf16 <->
  fp16, fp8 <-> mxfp8) and a GEMM format also for fp32 (the layer not lowered at all).
- *backend*: keep the policy and break the backend under it: the nvfp4 quantiser a no-op
  (nvfp4 layers compute in fp32), fp16 regions autocast to bf16, tf32 rounding a no-op.

Before tests/apply/refs.py compared at fp32's tolerance, the comparison ran at the lowest
precision's tolerance (nvfp4: rtol 0.5, atol 0.1) and let, e.g., ``single-nvfp4`` pass with
the layer in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from autoprec.formats.precisions import AUTOCAST_DTYPES, PRECISIONS
from autoprec.plan import resolve
from autoprec.policy import Policy, gemm_leaf_paths
from tests.apply import test_apply_boundaries as boundaries
from tests.apply import test_apply_mixed as mixed

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")

#: The wrong precisions a rule at each precision is swapped for.
WRONG = {"fp32": ("tf32",), "tf32": ("fp32",), "bf16": ("fp16", "fp32"), "fp16": ("bf16", "fp32"),
         "fp8": ("mxfp8", "fp32"), "mxfp8": ("fp8",), "nvfp4": ("mxfp8", "fp32")}
DEFAULT = "<default>"

#: Every case of test_apply_boundaries: (test id, case factory, target).
CASES: list[tuple[str, Callable[[], boundaries.Case], str | None]] = [
    *((f"test_net_boundaries[{c}-{p}]", lambda c=c, p=p: boundaries.net_case(p, c), None)
      for p in PRECISIONS for c in boundaries.NET_CASES),
    *((f"test_tied_weights_two_precisions[{d}-{p}]",
       lambda p=p, d=d: boundaries.tied_case(p, d), None)
      for p in PRECISIONS for d in ("fp32", "bf16")),
    *((f"test_module_called_twice[{d}-{p}]", lambda p=p, d=d: boundaries.twice_case(p, d), None)
      for p in PRECISIONS for d in ("fp32", "fp16")),
    *((f"test_shared_module_under_two_paths[{p}]", lambda p=p: boundaries.shared_case(p), None)
      for p in ("bf16", "fp16", "fp8")),
    ("test_bf16_then_fp16_outputs_meet_in_cat_as_on_cuda", boundaries.cat_case, "h100"),
    ("test_sdpa_with_q_k_v_from_three_precisions", boundaries.sdpa_case, None),
]


def _mutated(pol: Policy, rule: str, wrong: str) -> Policy:
    """``pol`` with ``rule`` (a path, the paths of one shared module joined by ``/``, or
    the default) at ``wrong``."""
    if rule == DEFAULT:
        return Policy(default=wrong, layers=dict(pol.layers))
    return Policy(default=pol.default,
                  layers={**pol.layers, **dict.fromkeys(rule.split("/"), wrong)})


def _rules(model: torch.nn.Module, pol: Policy) -> Iterator[tuple[str, str]]:
    """(rule, its precision) for every rule, the paths of one shared module together (one
    rule: giving them different precisions is a PolicyError), and for the default where it
    decides a GEMM layer's precision (a default left only the glue between layers that
    have rules — a ReLU — changes nothing: those mutants are not wrong, only equal)."""
    resolved = resolve(pol, model)
    if any(resolved[p].rule is None for p in gemm_leaf_paths(model)):
        yield DEFAULT, pol.default
    by_module: dict[int, list[str]] = {}
    for path in pol.layers:
        by_module.setdefault(id(model.get_submodule(path)), []).append(path)
    for paths in by_module.values():
        yield "/".join(paths), pol.layers[paths[0]]


#: Mutants of two rules at once: the audit's example (q and k both in fp32).
TWO_RULES = [("test_sdpa_with_q_k_v_from_three_precisions", boundaries.sdpa_case, None,
              "q/k", "fp32")]


def policy_mutations() -> Iterator[tuple[str, Callable[[], boundaries.Case], str | None,
                                         str, str]]:
    """(test id, case factory, target, rule, wrong precision) of every policy mutant."""
    for test, make, target in CASES:
        model, pol, _ = make()
        for rule, prec in _rules(model, pol):
            for wrong in WRONG[prec]:
                if rule == DEFAULT and wrong not in AUTOCAST_DTYPES and wrong not in (
                        "fp32", "tf32"):
                    continue  # a default is a region: never a GEMM format
                yield test, make, target, rule, wrong
    yield from TWO_RULES


def _policy_params() -> Iterator[Any]:
    for test, make, target, rule, wrong in policy_mutations():
        yield pytest.param(make, target, rule, wrong, id=f"{test}-{rule}={wrong}")


@pytest.mark.parametrize("make, target, rule, wrong", list(_policy_params()))
def test_a_rule_in_the_wrong_precision_fails_the_boundary_check(
        make: Callable[[], boundaries.Case], target: str | None, rule: str, wrong: str) -> None:
    model, pol, hand = make()
    with pytest.raises(AssertionError):
        boundaries.check(model, pol, hand, applied=_mutated(pol, rule, wrong), target=target)


def _identity(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x.float()


#: name -> (the precision it breaks, what it runs instead, how to break it).
BACKEND_FAULTS: dict[str, tuple[str, str, Callable[[pytest.MonkeyPatch], None]]] = {
    "nvfp4_quantiser_is_a_no_op": ("nvfp4", "fp32", lambda mp: (mp.setattr(
        "autoprec.lower.blockscale.fake_quant_nvfp4", _identity), mp.setattr(
        "autoprec.lower.nvfp4_train.fake_quant_nvfp4_1d", _identity))),  # + the train form's
    "fp16_autocasts_to_bf16": ("fp16", "bf16", lambda mp: mp.setitem(
        AUTOCAST_DTYPES, "fp16", torch.bfloat16)),
    "tf32_rounding_is_a_no_op": ("tf32", "fp32", lambda mp: mp.setattr(
        "autoprec.lower.forward.round_to_tf32", lambda x: x)),
}


@pytest.mark.parametrize("case", boundaries.NET_CASES)
@pytest.mark.parametrize("fault", list(BACKEND_FAULTS))
def test_a_backend_computing_the_wrong_precision_fails_the_boundary_check(
        fault: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prec, _, breaks = BACKEND_FAULTS[fault]
    model, pol, hand = boundaries.net_case(prec, case)
    boundaries.check(model, pol, hand)  # the unbroken backend passes
    breaks(monkeypatch)
    with pytest.raises(AssertionError):
        boundaries.check(model, pol, hand)


#: MIXED (test_apply_mixed) with one rule's precision swapped.
MIXED_MUTATIONS = [(rule, wrong) for rule, prec in mixed.MIXED.items() for wrong in WRONG[prec]]


@pytest.mark.parametrize("rule, wrong", MIXED_MUTATIONS,
                         ids=[f"{r}={w}" for r, w in MIXED_MUTATIONS])
def test_a_rule_in_the_wrong_precision_fails_the_mixed_check(rule: str, wrong: str) -> None:
    mixed.check_mixed()  # the policy itself passes
    with pytest.raises(AssertionError):
        mixed.check_mixed({**mixed.MIXED, rule: wrong})
