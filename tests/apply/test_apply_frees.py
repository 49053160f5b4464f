"""A removed plan leaves nothing behind: its cast / quantised copies of the weights go.

The search applies, scores and removes one candidate after another (autoprec.tuning.memory's
budget: the model plus one copy); a copy a removed plan kept would add up candidate by
candidate. Freed here means: no reference left (a weakref to it dies), no cache attribute.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.lower.fp8 import WEIGHT_CACHES, drop_weight_caches
from autoprec.policy import Policy

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
X = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()


def _caches(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, a) for name, m in model.named_modules() for a in WEIGHT_CACHES
            if a in m.__dict__]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_the_train_forms_quantised_weight_cache_goes_with_the_plan(fmt: str) -> None:
    model = _net()
    with apply_policy(model, Policy(default="fp32", layers={"2": fmt}, form="train")), \
            torch.no_grad():
        model(X)
        cached = _caches(model)
        assert cached and cached[0][0] == "2", cached  # the lowering caches its weight
        ref = weakref.ref(model[2].__dict__[cached[0][1]][1][0] if fmt == "fp8" else
                          model[2].__dict__[cached[0][1]][1])
    assert _caches(model) == []
    gc.disable()  # freed by reference counting alone, not left to the cycle collector
    try:
        assert ref() is None
    finally:
        gc.enable()


def test_the_deploy_forms_stored_copies_are_freed_on_remove() -> None:
    model = _net()
    handle = apply_policy(model, Policy(default="bf16", layers={"2": "fp8"}, form="deploy"))
    with torch.no_grad():
        model(X)
    cast = weakref.ref(model[0].weight)  # the bf16 copy the deploy form stores
    quantised = weakref.ref(model[2].weight)  # the e4m3 elements
    assert cast().dtype == torch.bfloat16 and quantised().dtype == torch.float8_e4m3fn
    handle.remove()
    gc.collect()
    assert cast() is None and quantised() is None
    assert model[0].weight.dtype == torch.float32 and _caches(model) == []


def test_drop_weight_caches_counts_what_it_dropped() -> None:
    model = _net()
    with apply_policy(model, Policy(default="fp32", layers={"0": "fp8", "2": "fp8"},
                                    form="train")), torch.no_grad():
        model(X)
        assert drop_weight_caches(model) == 2
        assert drop_weight_caches(model) == 0
