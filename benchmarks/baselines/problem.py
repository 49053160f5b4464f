"""One tuning problem (model x budget x target) and fair accounting for the baselines.

Every method is scored by autoprec's own stages, so the numbers differ only by the search:

- the model, data, fp32 references, graph, op trace, probes and cost model come from
  ``autoprec.tuning.tune.prepare`` with the options ``tune`` ran with (the probes are a hit
  in the probe cache ``tune`` wrote);
- plans are plan keys (``autoprec.search.space``: the default region first, then one
  precision per layer variable), priced by the whole-forward cost model through
  ``PlanSpace.times`` (casts at every boundary included);
- errors come from one shared ``PlanScorer`` (the policy applied, the calibration data run
  and compared with fp32; screening on a quarter of the batches first; a plan within
  budget on calibration data confirmed on the eval data at once, so ``feasible`` means
  within budget on both);
- the chosen plan is picked by ``select.choose`` (the fastest feasible plan, else the
  closest), as ``tune`` picks its own.

The space the baselines search is :attr:`Model.space` (:func:`open_space`): per layer the
precisions the graph allows on the target device, *without* the probes' measured facts (a
tool without autoprec's probes does not know that a layer overflows fp16). ``tune``
searches its own space (the same variables, narrowed by its probes), so keys of the two
spaces are interchangeable.

The baselines share one cache of scored plans so that the benchmark runs in minutes, but
each method is charged as if it had started with an empty cache: :class:`Counter` adds, for
every plan the method asks for the first time, the evaluations (full-calibration-set
equivalents: a plan rejected on the screening subset costs a quarter) and the seconds that
plan cost when it was first run. Eval-data confirmations are charged to nobody (``tune``'s
``PlanScorer`` does not count them either); all-fp32 is free (it is the reference). A key
that compiles to a plan the method has already measured (the same
``plan.schedule.signature``: e.g. two default regions that no op runs in once every GEMM
has its own rule) is the same plan: it is neither run nor charged again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from autoprec.formats.precisions import PRECISIONS
from autoprec.plan.schedule import signature
from autoprec.probe import probe
from autoprec.probe.table import SensitivityTable
from autoprec.search import compaction, select
from autoprec.search.plan_score import PlanScore
from autoprec.search.planner import ENUMERATE, PlanSpace, descend, enumerate_keys
from autoprec.search.space import Key, SearchSpace
from autoprec.study.objective import PlanScorer
from autoprec.tuning.config import TuneConfig
from autoprec.tuning.prepare import Prepared, make_space, prepare


def config(budget: float, *, target: str, batch_size: int, out: Path, cache_dir: Path
           ) -> TuneConfig:
    """The options ``tune`` runs with in the benchmark (the defaults a user gets, plus the
    budget, target, deployment batch and where its files go)."""
    return TuneConfig(max_error=budget, target=target, batch_size=batch_size,
                      storage="memory", out=out, progress=False,
                      cache_dir=cache_dir).validated()


class _GraphFacts:
    """The probe table's hard exclusions that are facts of the graph, not measurements: a
    precision the module cannot compute in (fp8 on an attention block: its Linear layers
    are variables of their own, so the rule would only alias fp16 inside)."""

    def __init__(self, table: SensitivityTable | None) -> None:
        self.rows = [] if table is None else [r for r in table.rows if not r.allowed]

    def hard_excluded(self) -> dict[tuple[str, str], str]:
        return {(r.layer, r.precision): r.reason for r in self.rows}


def open_space(prep: Prepared, cfg: TuneConfig) -> SearchSpace:
    """``tune``'s space without the probes' measured facts (overflow, non-finite output,
    underflow): graph x target device only."""
    return make_space(replace(prep, table=_GraphFacts(prep.table)), cfg)


@dataclass
class Model:
    """What does not depend on the budget: ``tune``'s prepared model and the open space."""

    prep: Prepared
    cfg: TuneConfig  # the options of the first budget (the probes are re-read per budget)
    space: SearchSpace  # graph x device: what a tool without autoprec's probes sees
    _priced: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _fastest: Key | None = field(default=None, repr=False)
    _signatures: dict[Key, tuple] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.prep.spec.name

    @property
    def cost(self) -> Any:
        return self.prep.cost

    def table(self, budget: float) -> SensitivityTable:
        """The probes exactly as ``tune`` ran them at ``budget`` (a hit in its probe cache:
        the arguments are ``tune.prepare``'s)."""
        cfg = self.cfg
        return probe(self.prep.net, self.prep.calib,
                     precisions=[p for p in cfg.search.precisions if p != "fp32"],
                     forward=self.prep.spec.forward, loss=None, metric=None,
                     graph=self.prep.graph, budget=budget, cache_dir=cfg.output.cache_dir,
                     progress=False)

    def priced(self, plans: PlanSpace) -> tuple[np.ndarray, np.ndarray]:
        """Every plan key of the open space (N, 1 + V) and its estimated time (N,), for
        spaces of at most ``planner.ENUMERATE`` plans (times do not depend on the budget)."""
        if self._priced is None:
            keys = enumerate_keys(self.space)
            self._priced = keys, plans.times(keys)
        return self._priced

    def signature(self, key: Key, plans: PlanSpace) -> tuple:
        """What plan ``key`` runs (``plan.schedule.signature``): two keys with the same
        signature run the same kernels on the same dtypes with the same casts."""
        sig = self._signatures.get(key)
        if sig is None:
            codes = self.space.codes(np.array([key], dtype=np.intp))
            sig = signature(self.cost.price(plans.rules, codes).schedule, 0)
            self._signatures[key] = sig
        return sig

    def fastest(self, plans: PlanSpace) -> Key:
        """The fastest plan of the open space by the cost model (no model run): every plan
        priced when the space can be enumerated, else the planner's descent at λ = 0
        (time alone; block and region moves from every uniform start)."""
        if self._fastest is None:
            if self.space.size <= ENUMERATE:
                keys, times = self.priced(plans)
                self._fastest = tuple(int(c) for c in keys[int(np.argmin(times))])
            else:
                found = descend(plans, 1.0, lambdas=[0.0])
                self._fastest = min(found, key=lambda k: found[k][0])
        return self._fastest


def load(path: str | Path, *, budget: float, target: str, batch_size: int, work: Path,
         cache_dir: Path) -> Model:
    cfg = config(budget, target=target, batch_size=batch_size, out=work / "baselines.yaml",
                 cache_dir=cache_dir)
    prep = prepare(path, cfg)
    return Model(prep, cfg, open_space(prep, cfg))


@dataclass
class Scored:
    """A scored plan and what scoring it cost the first time."""

    evaluation: PlanScore
    evaluations: float
    seconds: float


class Problem:
    """One model at one budget: a shared, charged-per-method PlanScorer."""

    def __init__(self, model: Model, budget: float) -> None:
        self.model, self.budget = model, budget
        self.table = model.table(budget)
        prep = model.prep
        self.plans = PlanSpace(model.space, prep.cost, self.table.estimate)
        self.evaluator = PlanScorer(
            spec=prep.spec, model=prep.net, batches=prep.calib, ref=prep.ref,
            plans=self.plans, budget=budget, target=prep.target,
            eval_batches=None if prep.same_data else prep.eval_batches,
            eval_ref=None if prep.same_data else prep.eval_ref)
        self.scored: dict[tuple, Scored] = {}  # by signature

    @property
    def space(self) -> SearchSpace:
        return self.model.space

    @property
    def fp32_key(self) -> Key:
        return self.space.uniform("fp32")

    def fastest(self) -> Key:
        return self.model.fastest(self.plans)

    def speedup(self, key: Key) -> float:
        t = self.plans.time(key)
        return self.model.cost.fp32_time / t if 0 < t < math.inf else 0.0

    def signature(self, key: Key) -> tuple:
        return self.model.signature(key, self.plans)

    def score(self, key: Key) -> Scored:
        sig = self.signature(key)
        hit = self.scored.get(sig)
        if hit is None:
            before, t0 = self.evaluator.evaluations, time.perf_counter()
            ev = self.evaluator(key)
            hit = Scored(ev, self.evaluator.evaluations - before, time.perf_counter() - t0)
            self.scored[sig] = hit
        return hit

    def counter(self, cap: float | None = None) -> Counter:
        return Counter(self, cap)

    def describe(self, key: Key) -> str:
        """The plan as the compact policy tune would write for it."""
        default, layers = self.space.rules(key)
        default, rules = compaction.compact(self.model.cost, default, layers,
                                         defaults=self.space.region.choices)
        return describe(default, rules)


def describe(default: str, rules: dict[str, str], limit: int = 8) -> str:
    """``default: bf16; a=fp16 b=fp32`` (on big policies a count per precision)."""
    if not rules:
        return f"default {default}, no rules"
    if len(rules) <= limit:
        return f"default {default}; " + " ".join(f"{k}={v}" for k, v in rules.items())
    by: dict[str, list[str]] = {}
    for k, v in rules.items():
        by.setdefault(v, []).append(k)
    return f"default {default}; " + "; ".join(
        f"{p}: {', '.join(ks)}" if len(ks) <= 3 else f"{p}: {len(ks)} rules"
        for p, ks in sorted(by.items(), key=lambda kv: PRECISIONS.index(kv[0])))


@dataclass
class Outcome:
    """What one method reached: the plan chosen by ``select.choose`` and its cost."""

    method: str
    policy: str  # compact policy text
    est_speedup: float
    error: float  # calibration
    eval_error: float
    feasible: bool  # within budget on calibration and eval data
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
        self.seen: dict[Key, PlanScore] = {}
        self.by_signature: dict[tuple, PlanScore] = {}  # the distinct plans measured
        self.order: list[Key] = []
        self.evaluations = 0.0
        self.seconds = 0.0
        self.started = time.perf_counter()
        self._own = 0.0  # wall time spent inside shared scoring (replaced by charged seconds)
        # all-fp32 is free (nothing lowered: the reference) and always within budget: what
        # a user keeps when a method finds nothing better
        self(problem.fp32_key)

    def __call__(self, key: Key) -> PlanScore:
        key = tuple(int(c) for c in key)
        if key in self.seen:
            return self.seen[key]
        t0 = time.perf_counter()
        sig = self.problem.signature(key)
        if sig in self.by_signature:  # the same plan under another key: nothing to run
            self._own += time.perf_counter() - t0
            self.seen[key] = self.by_signature[sig]
            return self.seen[key]
        if self.cap is not None and self.evaluations >= self.cap:
            raise Exhausted(f"capped at {self.cap:g} evaluations")
        s = self.problem.score(key)
        self._own += time.perf_counter() - t0
        self.evaluations += s.evaluations
        self.seconds += s.seconds
        self.seen[key] = self.by_signature[sig] = s.evaluation
        self.order.append(key)
        return s.evaluation

    def chosen(self) -> tuple[Key, PlanScore, bool]:
        space = self.problem.space
        cands = [select.Candidate(i, space.params(k), self.seen[k])
                 for i, k in enumerate(self.order)]
        c, feasible = select.choose(cands, budget=self.problem.budget, min_speedup=None)
        return space.key(c.params), c.calib, feasible

    def outcome(self, method: str, *, probe_cost: float = 0.0, probe_seconds: float = 0.0,
                note: str = "") -> Outcome:
        key, ev, feasible = self.chosen()
        overhead = time.perf_counter() - self.started - self._own
        eval_err = ev.eval_error if ev.eval_error is not None else (
            ev.error if self.problem.model.prep.same_data else math.nan)
        return Outcome(method, self.problem.describe(key), ev.est_speedup, ev.error,
                       eval_err, feasible, self.evaluations,
                       self.seconds + overhead + probe_seconds, probe_cost, note)
