"""Speed-ups of a 16-bit model are over all-fp32 (``model.float()``), as for any model.

DESIGN: ``est_speedup`` is over all-fp32 on the target. The fp32 reference was once priced
in the training form, which keeps the weights it is given: for a bf16 model that "fp32"
was the bf16 model itself, and every est_speedup equalled the speed-up over the model as
given (the 1.1 B bf16 Llama's plan printed 1.13x "over fp32" instead of 10.25x).
"""

from __future__ import annotations

import pytest

from autoprec.cost import CostModel, get_profile
from autoprec.policy import Policy
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file
from tests.helpers import MODELS


@pytest.fixture(scope="module")
def graph():
    spec = load_model_file(MODELS / "bf16_llama.py")
    return trace(spec.model(), spec.calibration_batches()[0], forward=spec.forward)


def test_a_bf16_models_fp32_reference_is_its_weights_upcast(graph) -> None:
    cost = CostModel(graph, get_profile("h100"), 4096)  # 64 x 16 tokens a row: 16 bits shows
    upcast = cost.estimate(Policy(default="fp32", form="deploy"))  # model.float()
    assert cost.fp32_time == pytest.approx(upcast, rel=1e-9)
    given = Policy(default="bf16", form="deploy")  # the model as it is
    # width 64: bytes more than FLOPs set the time, so bf16 gains ~1.2x, not the 15x of peaks
    assert cost.speedup(given) == pytest.approx(upcast / cost.estimate(given), rel=1e-9)
    assert cost.speedup(given) > 1.1
    # the search's scale of time is the model as given, not the upcast nobody runs
    assert cost.reference_time == pytest.approx(cost.estimate(given), rel=1e-9)


def test_an_fp32_models_reference_is_unchanged() -> None:
    from tests import zoo

    case = zoo.mlp()
    g = trace(case.model, case.batch)
    cost = CostModel(g, get_profile("h100"), 4096)
    assert cost.fp32_time == pytest.approx(cost.estimate(Policy(default="fp32", form="train")),
                                           rel=1e-9)
    assert cost.reference_time == cost.fp32_time
