"""One tuning problem (model x budget x target) and fair accounting for the baselines.

Every method is scored by autoprec's own stages, so the numbers differ only by the
search: the same ``Evaluator`` (apply the policy, run the calibration data, compare with
fp32; screening on a quarter of the batches first), the same cost model at the deployment
batch size, and the same selection rule (``select.choose``: the fastest candidate feasible
on calibration data whose eval-data error is within budget, up to five tried).

The baselines share one cache of scored assignments so that the benchmark runs in
minutes, but each method is charged as if it had started with an empty cache:
:class:`Counter` adds, for every assignment the method asks for the first time, the
evaluations (full-calibration-set equivalents) and the seconds that assignment cost when
it was first run. Eval-data confirmations are not charged to any method (tune does not
count them either).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autoprec.cost import CostModel, get_profile
from autoprec.evaluate import Reference, reference
from autoprec.loading import ModelSpec, load_model_file
from autoprec.metrics import batch_size_of
from autoprec.precisions import PRECISIONS
from autoprec.probe import probe
from autoprec.probe.table import SensitivityTable
from autoprec.search import select
from autoprec.search.evaluation import Evaluation
from autoprec.search.objective import Evaluator
from autoprec.search.space import SearchSpace
from autoprec.search.tune import _space
from autoprec.trace import trace
from autoprec.trace.graph import LayerGraph


@dataclass
class Model:
    """What does not depend on the budget: model, data, references, graph, cost model."""

    spec: ModelSpec
    net: Any
    calib: list[Any]
    eval_batches: list[Any]
    ref: Reference
    eval_ref: Reference
    graph: LayerGraph
    cost: CostModel
    precisions: tuple[str, ...]
    batch_size: int
    target: str
    space: SearchSpace  # graph x device only: what a tool without autoprec's probes sees
    table: SensitivityTable | None = None  # filled by load_table (after tune probed)

    @property
    def name(self) -> str:
        return self.spec.name

    def speedup(self, params: Mapping[str, str]) -> float:
        return self.cost.estimate({}) / self.cost.estimate(self.space.assignment(params))

    def load_table(self, cache_dir: Path) -> SensitivityTable:
        """The probes exactly as ``tune`` ran them (a hit in tune's probe cache)."""
        if self.table is None:
            self.table = probe(self.net, self.calib,
                               precisions=[p for p in self.precisions if p != "fp32"],
                               forward=self.spec.forward, loss=self.spec.loss, metric=None,
                               graph=self.graph, cache_dir=cache_dir, progress=False)
        return self.table


def load(path: str | Path, *, precisions: Sequence[str], target: str,
         batch_size: int | None) -> Model:
    # The budgets here are relative L2 errors (``--max-error``): score that, as tune does
    # when a model.py with a metric is tuned with --max-error.
    spec = replace(load_model_file(path), metric=None)
    net = spec.model()
    calib = spec.calibration_batches()
    eval_batches = spec.eval_batches()
    ref = reference(spec, net, calib, "of calibration_data")
    eval_ref = reference(spec, net, eval_batches, "of eval_data")
    graph = trace(net, calib[0], forward=spec.forward, model_name=spec.name)
    profile = get_profile(target)
    bs = batch_size or batch_size_of(calib[0]) or 1
    cost = CostModel(graph, profile, batch_size=bs)
    wanted = tuple(p for p in PRECISIONS if p in precisions or p == "fp32")
    space = _space(graph, None, profile, wanted, ())
    return Model(spec, net, calib, eval_batches, ref, eval_ref, graph, cost, wanted, bs,
                 target, space)


@dataclass
class Scored:
    """A scored assignment and what scoring it cost the first time."""

    evaluation: Evaluation
    evaluations: float
    seconds: float


class Problem:
    """One model at one budget: a shared, charged-per-method Evaluator."""

    def __init__(self, model: Model, budget: float) -> None:
        self.model, self.budget = model, budget
        # error in the budget's units: relative L2 of the outputs (our models have no metric)
        self.evaluator = Evaluator(spec=model.spec, model=model.net, batches=model.calib,
                                   ref=model.ref, cost=model.cost, space=model.space,
                                   budget=budget)
        self.scored: dict[tuple[str, ...], Scored] = {}
        self.eval_errors: dict[tuple[str, ...], float] = {}

    @property
    def space(self) -> SearchSpace:
        return self.model.space

    def score(self, params: Mapping[str, str]) -> Scored:
        key = self.evaluator.key(params)
        hit = self.scored.get(key)
        if hit is None:
            before, t0 = self.evaluator.evaluations, time.perf_counter()
            ev = self.evaluator(params)
            hit = Scored(ev, self.evaluator.evaluations - before, time.perf_counter() - t0)
            self.scored[key] = hit
        return hit

    def eval_error(self, params: Mapping[str, str]) -> float:
        """Error on the eval data (the budget binds there); cached, charged to nobody."""
        key = self.evaluator.key(params)
        if key not in self.eval_errors:
            self.eval_errors[key] = self.evaluator.error(params, self.model.eval_batches,
                                                         self.model.eval_ref, "of eval_data")
        return self.eval_errors[key]

    def counter(self, cap: float | None = None) -> Counter:
        return Counter(self, cap)


@dataclass
class Outcome:
    """What one method reached: the policy chosen by ``select.choose`` and its cost."""

    method: str
    params: dict[str, str]
    est_speedup: float
    error: float  # calibration
    eval_error: float
    feasible: bool  # calibration-feasible and confirmed on eval data
    evaluations: float
    seconds: float
    probe_cost: float = 0.0  # forward-pass equivalents over the calibration data
    note: str = ""

    @property
    def within_budget_speedup(self) -> float:
        """What a user gets: the speed-up if the policy holds on eval data, else fp32's 1.0."""
        return self.est_speedup if self.feasible else 1.0


class Exhausted(Exception):
    """A method reached its evaluation cap (the benchmark's time limit, not the method's)."""


class Counter:
    """A method's view of the shared scores: charges first requests, keeps candidates.

    ``cap``: raise :class:`Exhausted` once this many evaluations are charged."""

    def __init__(self, problem: Problem, cap: float | None = None) -> None:
        self.problem, self.cap = problem, cap
        self.seen: dict[tuple[str, ...], Evaluation] = {}
        self.order: list[dict[str, str]] = []
        self.evaluations = 0.0
        self.seconds = 0.0
        self.started = time.perf_counter()
        self._own = 0.0
        # all-fp32 is free (nothing lowered: the reference) and always within budget: what
        # a user keeps when a method finds nothing better
        self(problem.space.uniform(problem.space.default))  # wall time spent inside shared scoring (replaced by charged seconds)

    def __call__(self, params: Mapping[str, str]) -> Evaluation:
        params = {v.name: params.get(v.name, self.problem.space.default)
                  for v in self.problem.space.variables}
        key = self.problem.evaluator.key(params)
        if key in self.seen:
            return self.seen[key]
        if self.cap is not None and self.evaluations >= self.cap:
            raise Exhausted(f"capped at {self.cap:g} evaluations")
        t0 = time.perf_counter()
        s = self.problem.score(params)
        self._own += time.perf_counter() - t0
        self.evaluations += s.evaluations
        self.seconds += s.seconds
        self.seen[key] = s.evaluation
        self.order.append(params)
        return s.evaluation

    def outcome(self, method: str, *, probe_cost: float = 0.0, probe_seconds: float = 0.0,
                note: str = "") -> Outcome:
        cands = [select.Candidate(i, p, self.seen[self.problem.evaluator.key(p)])
                 for i, p in enumerate(self.order)]
        chosen, feasible = select.choose(cands, budget=self.problem.budget, min_speedup=None,
                                         confirm=self.problem.eval_error)
        overhead = time.perf_counter() - self.started - self._own
        ev_err = chosen.eval_error if chosen.eval_error is not None else math.nan
        return Outcome(method, dict(chosen.params), chosen.calib.est_speedup,
                       chosen.calib.error, ev_err, feasible, self.evaluations,
                       self.seconds + overhead + probe_seconds, probe_cost, note)
