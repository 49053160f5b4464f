"""README: "Spaces up to 2 M plans are enumerated; larger ones are searched by a Lagrangian
descent". The bound is ``planner.ENUMERATE``, tested here at its real value (not patched
down): spaces of exactly 2,000,000 plans and of the next size up built from per-layer
choice lists.

A plan count is the product of the choices of the region variable (fp32, tf32, bf16, fp16:
4) and of every layer variable: 4 x 5**6 x 2**5 = 2,000,000 exactly (six layers that may
take fp32/tf32/bf16/fp16/fp8, five that may take fp32/bf16), and 4 x 5**6 x 2**4 x 3 =
3,000,000 with one layer given a third choice (fp16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoprec.cost import CostModel, get_profile
from autoprec.search import planner as planner_mod
from autoprec.search.planner import ENUMERATE, Planner
from autoprec.search.space import SearchSpace, build_space
from autoprec.trace import trace
from tests.zoo import GeluChain

FIVE = ["fp32", "tf32", "bf16", "fp16", "fp8"]
N = 11  # GEMM layers


def _space(over: bool) -> tuple[SearchSpace, CostModel]:
    torch.manual_seed(0)
    graph = trace(GeluChain(N, 16).eval(), torch.randn(4, 16), tracers=("hooks",))
    cost = CostModel(graph, get_profile("h100"), batch_size=65536)
    layers = [f"fcs.{i}" for i in range(N)]
    allowed = {lay: FIVE if i < 6 else ["fp32", "bf16"] for i, lay in enumerate(layers)}
    if over:
        allowed[layers[-1]] = ["fp32", "bf16", "fp16"]
    return build_space(layers, allowed, {}, FIVE), cost


def test_the_bound_is_the_readmes_2_million() -> None:
    assert ENUMERATE == 2_000_000


def test_the_spaces_sit_on_either_side_of_the_bound() -> None:
    under, _ = _space(over=False)
    over, _ = _space(over=True)
    assert [len(v.choices) for v in under.all_variables] == [4] + [5] * 6 + [2] * 5
    assert under.size == ENUMERATE == 2_000_000
    assert over.size == 3_000_000 > ENUMERATE


@pytest.mark.parametrize(("over", "method"), [(False, "enumeration"), (True, "other")])
def test_a_space_of_2_million_plans_is_enumerated_and_one_more_choice_is_not(
        over: bool, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which way the planner goes, at the real bound; pricing 2 M plans (seconds) is left
    to the slow test below: here the enumeration prices the first 64 keys it lists."""
    listed: list[int] = []
    real = planner_mod.enumerate_keys

    def first_keys(space: SearchSpace) -> np.ndarray:
        keys = real(space)
        listed.append(len(keys))
        return keys[:64]

    monkeypatch.setattr(planner_mod, "enumerate_keys", first_keys)
    space, cost = _space(over)
    pl = Planner(space, cost, lambda layer, p: 0.001, budget=0.003)
    if method == "enumeration":
        assert pl.method == "enumeration" and listed == [2_000_000]
    else:
        assert pl.method in ("descent", "repetition") and 2_000_000 not in listed
        assert 0 < len(pl) < space.size


@pytest.mark.slow
def test_every_one_of_2_million_plans_is_priced() -> None:
    space, cost = _space(over=False)
    pl = Planner(space, cost, lambda layer, p: 0.001, budget=0.003)
    assert pl.method == "enumeration" and pl.priced == len(pl) == 2_000_000
    assert np.isfinite(pl.times).all()
