"""pareto.png shows the chosen plan among its alternatives: every plan the search priced
(predicted error vs estimated speed-up), the plans measured on the model, fp32 and the
one-liners, and the budget (it showed the 1–3 measured plans alone: one point)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import autoprec
from autoprec.search.select import front_positions
from autoprec.track.plots import (
    MAX_PRICED_POINTS,
    pareto_data,
    pareto_figure,
    pareto_plot,
)
from tests.helpers import TRAP
from tests.track.figures import series


def _trials() -> pd.DataFrame:
    return pd.DataFrame({"number": [0, 1, 2], "state": ["COMPLETE", "COMPLETE", "PRUNED"],
                         "calibration_error": [0.004, 0.02, float("nan")],
                         "est_speedup": [1.8, 2.1, None], "feasible": [True, False, None]})


def test_pareto_data_holds_priced_measured_baselines_budget_and_chosen() -> None:
    rng = np.random.default_rng(3)
    errs, spds = rng.random(20_000) * 0.05, 1 + rng.random(20_000)
    errs[7] = math.inf  # an unpriceable prediction is not drawn
    base = pd.DataFrame({"plan": ["tuned", "fp32", "one global bf16", "one global fp16"],
                         "error": [0.004, 0.0, 0.03, math.inf],
                         "est_speedup": [1.8, 1.0, 1.6, 1.6]})
    d = pareto_data(_trials(), priced=(errs, spds), baselines=base, chosen_trial=0,
                    budget=0.01)
    assert d.priced_total == 19_999
    assert len(d.priced) == MAX_PRICED_POINTS  # sampled; the front is kept whole
    keep = np.isfinite(errs)
    want = front_positions(errs[keep].tolist(), spds[keep].tolist())
    assert d.priced_front == [(float(errs[keep][i]), float(spds[keep][i])) for i in want]
    assert d.feasible == [(0.004, 1.8)] and d.infeasible == [(0.02, 2.1)]
    assert [b[0] for b in d.baselines] == ["fp32", "one global bf16", "one global fp16"]
    assert d.chosen == (0.004, 1.8, "chosen (trial 0)") and d.budget == 0.01
    # a baseline that won the measurement is no trial: the chosen point is given
    d = pareto_data(_trials(), baselines=base, chosen_trial=-1, chosen=(0.0, 1.0))
    assert d.chosen == (0.0, 1.0, "chosen") and d.priced == []


def test_pareto_plot_draws_every_series(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    errs, spds = rng.random(500) * 0.05, 1 + rng.random(500)
    kwargs = {"chosen_trial": 0, "budget": 0.01, "priced": (errs, spds),
              "baselines": pd.DataFrame({"plan": ["fp32", "one global fp16"],
                                         "error": [0.0, math.inf], "est_speedup": [1.0, 1.6]})}
    got = series(pareto_figure(_trials(), **kwargs))
    priced = list(zip(errs.tolist(), spds.tolist()))
    assert sorted(got.pop("priced plans (500, predicted error)")) == sorted(priced)  # all 500
    assert got.pop("priced front") == [priced[i] for i in front_positions(*zip(*priced))]
    edge = max(errs.max(), 0.02) * 1.5  # right of every finite error (0.02: trial 1's)
    assert got == {
        "measured, feasible (1)": [(0.004, 1.8)],  # trial 0; trial 2 was pruned
        "measured, infeasible (1)": [(0.02, 2.1)],
        "measured front": [(0.004, 1.8), (0.02, 2.1)],
        "fp32": [(0.0, 1.0)],
        "one global fp16 (error inf, at edge)": [(edge, 1.6)],
        "chosen (trial 0)": [(0.004, 1.8)],
        "budget 0.01": [(0.01, 0.0), (0.01, 1.0)],  # a vertical line (y in axes units)
    }
    path = pareto_plot(_trials(), tmp_path / "p.png", **kwargs)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_passes_its_priced_plans_and_baselines_to_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = autoprec.tune(TRAP, max_error=0.01, target="h100", batch_size=65536, trials=2,
                           out=tmp_path / "p.yaml", progress=False, report=tmp_path / "r")
    plans = result.search.plot_plans
    errs, spds = plans.priced
    assert len(errs) == len(spds) == result.search.priced > 1000  # thousands, not the 1 measured
    assert max(spds) >= result.est_speedup * 0.999
    names = list(plans.baselines["plan"])
    assert names[0] == "fp32 (no autocast)" and any("bf16" in n for n in names)
    assert plans.chosen == (result.error, result.est_speedup)
    d = pareto_data(pd.DataFrame(result.search.trials_table), priced=plans.priced,
                    baselines=plans.baselines, chosen_trial=result.policy.provenance["trial"],
                    budget=result.plan.budget)
    assert d.priced_total == result.search.priced and d.feasible and d.chosen is not None
    assert (tmp_path / "r" / "pareto.png").is_file()
