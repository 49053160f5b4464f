"""The replay prices T plans at once (numpy rows): in the deploy form a module is wrapped in
some rows and runs by its own input rule in others, and each row must come out as if it
were priced alone (a value cast on entry in one row was once skipped by another row's
consumer rule, and 9 % of trap's plans were priced as unrunnable)."""

from __future__ import annotations

import numpy as np
import pytest

from autoprec.cost import CostModel, get_profile
from autoprec.plan.compile import CODE
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file
from tests.helpers import ROOT


@pytest.mark.parametrize("form", ["deploy", "train"])
def test_plans_priced_together_price_as_alone(form: str) -> None:
    spec = load_model_file(ROOT / "examples" / "trap" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    cost = CostModel(trace(model, batch, forward=spec.forward, tracers=("hooks",)),
                     get_profile("h100"), 65536, form=form)
    paths = ["inp", "blow", "mid1", "offset", "mid2", "head"]
    rules = cost.rules(paths)
    rng = np.random.default_rng(0)
    regions = [CODE[p] for p in ("fp32", "tf32", "bf16", "fp16")]
    choices = regions + [CODE["fp8"]]
    rows = np.array([[rng.choice(regions), *rng.choice(choices, len(paths))]
                     for _ in range(64)])
    together = cost.price(rules, rows)
    alone = np.array([cost.price(rules, r[None, :]).time[0] for r in rows])
    assert np.array_equal(together.time, alone)
    assert np.isfinite(alone).all(), together.reasons  # every trap plan runs
