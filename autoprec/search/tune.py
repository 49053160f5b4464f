"""``tune``: from a model.py to a policy file, in stages a reader can follow.

    prepare  load the model and data, the up-front memory check, the references (the
             model's own outputs, as given: fp32, bf16, fp16 or mixed), trace (graph + op
             trace), probes, the cost model at the deployment batch size
    space    the default region and one variable per GEMM layer, narrowed by hard facts
    search   the planner (search/planner.py) as an Optuna sampler over a shared study
    select   the fastest plan within budget on eval data (or the closest, infeasible)
    write    the compact policy (+ Pareto front), MLflow artifacts

This module orchestrates; the numerics live in the stages it calls. Tracking is a
callback of the search and a last step of write.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
import torch
from tqdm.auto import tqdm

import autoprec
from autoprec.cost import CostModel
from autoprec.cost.fusion import make_cost_model
from autoprec.errors import InputError
from autoprec.evaluate import Reference, batch_tensors, reference, same_tensors, score
from autoprec.formats.gemm import is_forward_only
from autoprec.hashing import code_hash, data_hash, weights_hash
from autoprec.loading import ModelSpec, load_model_file
from autoprec.memory import StagePeaks, check_fits, peak_bytes, release_freed, reset_peak
from autoprec.metrics import batch_size_of
from autoprec.paths import check_out_path, remove_stale_fronts
from autoprec.policy import Policy
from autoprec.precisions import PRECISIONS
from autoprec.probe import probe
from autoprec.reference import ModelReference, model_reference, offered, own_precision
from autoprec.search import compact, select
from autoprec.search.config import TuneConfig
from autoprec.search.confirm_speed import SpeedCheck, confirm_tune, speed_metrics
from autoprec.search.decode import TrialDecoder
from autoprec.search.driver import Driver, TrialResult, trial_rows
from autoprec.search.export import META_KEY, policy_from_candidate, study_meta
from autoprec.search.local_profile import SpeedSource, calibration_dir
from autoprec.search.objective import Evaluator, given_policy
from autoprec.search.planner import Planner
from autoprec.search.sampler import PlanSampler
from autoprec.search.space import REGIONS, Key, SearchSpace, build_space
from autoprec.search.storage import (
    count_finished,
    describe_storage,
    join_study,
    open_storage,
    storage_errors,
)
from autoprec.search.target import resolve_target
from autoprec.trace import trace
from autoprec.trace.graph import LayerGraph
from autoprec.track import NullTracker, PlotPlans, Tracker, log_tune_artifacts
from autoprec.validate import check_out_not_input

#: The walk measures plans whose corrected prediction is within this factor of the budget.
MARGIN = 1.25
#: Below this estimated gain of the best uniform precision, the batch is launch-bound.
LAUNCH_BOUND = 1.10


@dataclass
class TuneResult:
    """What a tune produced: the chosen policy (written at ``path``) and how it was found."""

    policy: Policy
    path: Path | None
    feasible: bool
    error: float  # on the calibration data (budget units)
    eval_error: float  # on the eval data (budget units)
    est_speedup: float
    budget: float
    study_name: str
    storage: str
    trials: int  # trials this process ran
    evaluations: float  # model evaluations this process ran (full-set equivalents)
    seconds: float
    front: list[Policy] = field(default_factory=list)
    front_paths: list[Path] = field(default_factory=list)
    trials_table: list[dict[str, Any]] = field(default_factory=list)
    sensitivity: Any = None  # pandas DataFrame of the probes
    graph: LayerGraph | None = None
    notes: list[str] = field(default_factory=list)  # things the user should be told
    complete: bool = False  # the planner had nothing faster left to measure
    method: str = ""  # how the candidates were found (enumeration / descent)
    speed: SpeedCheck | None = None  # the plan beside its baselines; measured where local
    report: list[Path] = field(default_factory=list)  # files tune(report=DIR) wrote
    priced: int = 0  # plans the planner priced (the candidates it considered)
    measured: int = 0  # distinct plans measured on the model (this study, all runs)
    plot_plans: Any = None  # track.PlotPlans: what pareto.png shows beside the trials
    reference: ModelReference = field(default_factory=ModelReference)  # the model as given
    weight_bytes: int = 0  # the model's own weights (as given)
    peak_memory: int = 0  # bytes at the peak of the tune (autoprec.memory.peak_bytes)
    peak_memory_how: str = ""  # what was measured (peak RSS on CPU, allocated on CUDA)
    memory_stages: dict[str, int] = field(default_factory=dict)  # stage -> its own peak bytes


# -- stage 1: prepare ---------------------------------------------------------------------

@dataclass
class Prepared:
    """The model, its data and references, its graph, the probes and the cost model."""

    spec: ModelSpec
    net: torch.nn.Module
    calib: list[Any]
    eval_batches: list[Any]
    ref: Reference
    eval_ref: Reference
    same_data: bool
    graph: LayerGraph
    table: Any  # SensitivityTable
    cost: CostModel
    deploy_bs: int
    calib_bs: int
    out_path: Path
    source: SpeedSource | None = None  # where the speed figures come from (measured here?)
    reference: ModelReference = field(default_factory=ModelReference)  # the model as given


def prepare(model: str | Path | ModelSpec, cfg: TuneConfig, profile: Any = None,
            peaks: StagePeaks | None = None) -> Prepared:
    spec = model if isinstance(model, ModelSpec) else load_model_file(model)
    if cfg.use_metric and spec.metric is None:
        raise InputError(f"{spec.path}: --max-drop needs a metric(outputs, batch) in model.py")
    if cfg.train_aware and spec.loss is None:
        raise InputError(f"{spec.path}: --train-aware needs loss(outputs, batch) in model.py")
    out_path = cfg.out or Path("policies") / f"{spec.name}-{cfg.target}.yaml"
    check_out_path(out_path)  # before any expensive work
    check_out_not_input(out_path, model=spec.path, storage=cfg.storage)
    net = spec.model()
    refm = model_reference(net)
    check_fits(net, str(spec.path), cfg.memory_limit)  # the model twice, or one line now
    reset_peak(net)
    peaks = peaks if peaks is not None else StagePeaks()
    peaks.model = net
    if not refm.is_fp32 and (cfg.train_aware or cfg.form == "train"):
        what = "--train-aware" if cfg.train_aware else "--form train"
        raise InputError(f"{spec.path}: {what} runs autocast over fp32 master weights, but "
                         f"the model is {refm.label()}; tune it in the deploy form (the "
                         "default), or load it in fp32 to train it")
    calib = spec.calibration_batches()
    eval_batches = spec.eval_batches()
    same_data = spec.eval_data is None
    before = batch_tensors(calib[0])  # to tell an input changed in place from randomness
    with peaks.stage("reference"):
        ref, eval_ref, check = _references(spec, net, calib, eval_batches, same_data, cfg)
    if check.error != 0.0:
        if not same_tensors(before, batch_tensors(calib[0])):
            raise InputError(f"{spec.path}: forward() changes its input in place (batch 0 of "
                             "calibration_data differs after one forward, e.g. x.mul_()); "
                             "autoprec runs every batch many times: compute on a copy "
                             "(x = x * 2, or x.clone())")
        raise InputError(f"{spec.path}: the {refm.label()} model is not deterministic (two "
                         "runs differ "
                         f"by {check.error:.3g}); put it in eval mode / fix random ops")
    with peaks.stage("trace"):
        graph = trace(net, calib[0], forward=spec.forward, model_name=spec.name)
    unknown = [lk for lk in cfg.locked if lk not in graph]
    if unknown:
        raise InputError(f"--lock {unknown[0]!r}: {spec.path} has no such module")
    cache = cfg.cache_dir or out_path.parent / ".autoprec" / "probe-cache"
    # Gradient probes (model.py's loss) cost ~20 forward-equivalents; only training needs them.
    with peaks.stage("probe"):
        table = probe(net, calib, precisions=[p for p in cfg.precisions if p != "fp32"],
                      forward=spec.forward, loss=spec.loss if cfg.train_aware else None,
                      metric=spec.metric if cfg.use_metric else None, graph=graph,
                      budget=cfg.budget, cache_dir=cache, progress=cfg.progress)
    calib_bs = batch_size_of(calib[0]) or 1
    deploy_bs = cfg.batch_size or calib_bs
    target = resolve_target(cfg.target, compile=cfg.compile, measure=cfg.measure,
                            cache_dir=calibration_dir(out_path, cfg.cache_dir))
    source = target.speed
    # the one price source of a target (SpeedSource.cost_model): on a local CPU the model's
    # own ops timed here; an explicit profile (tests, experiments) prices by it alone
    cost = (make_cost_model(graph, profile, deploy_bs, cfg.mode, form=cfg.form)
            if profile is not None else
            source.cost_model(graph, deploy_bs, cfg.mode, form=cfg.form))
    if cfg.max_weight_mb is not None:  # a plan over it cannot deploy: priced as infeasible
        cost.max_weight_bytes = cfg.max_weight_mb * 1e6
    if not cfg.use_metric and spec.metric is not None:
        spec = replace(spec, metric=None)  # the budget is on relative L2: score that
    return Prepared(spec, net, calib, eval_batches, ref, eval_ref, same_data, graph, table,
                    cost, deploy_bs, calib_bs, out_path, source, refm)


def _references(spec: ModelSpec, net: Any, calib: list[Any], eval_batches: list[Any],
                same_data: bool, cfg: TuneConfig) -> tuple[Any, Any, Any]:
    """The model's own outputs on both sets, and a second run of it (determinism)."""
    ref = reference(spec, net, calib, "of calibration_data",  # also: the model accepts it
                    need_outputs=not cfg.use_metric)
    eval_ref = ref if same_data else reference(spec, net, eval_batches, "of eval_data")
    check = score(spec, net, calib, ref, "of calibration_data")
    return ref, eval_ref, check


# -- stage 2: the space -------------------------------------------------------------------

def make_space(prep: Prepared, cfg: TuneConfig) -> SearchSpace:
    """Choices per GEMM layer: graph eligibility ∩ target device ∩ probes' hard facts ∩
    what the layer's own precision offers (``reference.offered``: a bf16 layer takes bf16,
    fp16, the GEMM formats and an fp32 island, never tf32); the default region's: the
    regions the target runs among the precisions asked for, offered by the model's own."""
    profile = prep.cost.profile
    device_why = {p: profile.supports(p)[1] for p in PRECISIONS if not profile.supports(p)[0]}
    hard = prep.table.hard_excluded() if prep.table is not None else {}
    modules = dict(prep.net.named_modules())
    layers, allowed, excluded = [], {}, {}
    for node in prep.graph.gemm_nodes:
        if not node.is_leaf and node.kind not in ("attention", "matmul"):
            continue
        layers.append(node.path)
        # above the layer's own precision: not a choice, and (like the target's gaps) no
        # reason to list on every layer (the policy's `reference:` says it once)
        mod = modules.get(node.path)
        own = offered(own_precision(mod), PRECISIONS) if mod is not None else PRECISIONS
        why_not = {p: r for p, r in node.disallowed.items()
                   if p in cfg.precisions and p not in device_why}
        for p in cfg.precisions:  # the target's own gaps are no layer's reason: not listed
            if is_forward_only(p) and cfg.train_aware:
                why_not.setdefault(p, f"{p}: forward-only (no gradient recipe): not for "
                                      "--train-aware")
            if (node.path, p) in hard:
                why_not.setdefault(p, hard[(node.path, p)])
        allowed[node.path] = [p for p in node.allowed if p in cfg.precisions and p in own
                              and p not in why_not and p not in device_why]
        excluded[node.path] = why_not
    if not layers:
        raise InputError(
            f"nothing to tune: {prep.spec.path} has no GEMM layer (Linear, Conv, matmul, "
            "attention) whose precision autoprec can choose; its forward is priced at "
            f"{prep.cost.fp32_time * 1e6:.3g} µs in fp32 on {cfg.target}")
    regions = [p for p in REGIONS if p in cfg.precisions and p not in device_why
               and p in offered(prep.reference.default, PRECISIONS)]
    space = build_space(layers, allowed, excluded, cfg.precisions, locked=cfg.locked,
                        regions=regions)
    if not any(len(v.choices) > 1 for v in space.all_variables):
        why = sorted({w for v in space.variables for w in v.excluded.values()}
                     | {device_why[p] for p in cfg.precisions if p in device_why})
        raise InputError(
            f"nothing to tune: no layer of {prep.spec.name} may take "
            f"{', '.join(p for p in cfg.precisions if p != 'fp32') or 'a precision below fp32'}"
            f" on {cfg.target}" + (f" ({'; '.join(why)[:300]})" if why else ""))
    return space


def reference_key(space: SearchSpace, refm: ModelReference) -> Key | None:
    """The plan key that runs the model as given (error 0: it changes no tensor), or None
    when no key does (a module kept in fp32 that is no GEMM layer: the region covers it).
    None for an fp32 model: the evaluator's default, the all-fp32 plan, is that one."""
    if refm.is_fp32 or refm.islands:
        # a mixed model's fp32 modules often cast their own inputs and outputs (T5's `wo`):
        # the deploy form's fp32 rule on them changes what they hand on, so its error is
        # measured like any plan's, not assumed 0
        return None
    key = [PRECISIONS.index(refm.default)]
    for v in space.variables:
        want = {refm.islands.get(lay, refm.default) for lay in v.layers}
        if len(want) != 1 or (p := want.pop()) not in v.choices:
            return None
        key.append(PRECISIONS.index(p))
    if refm.default not in space.region.choices:
        return None
    return tuple(key)


# -- stage 3: the search ------------------------------------------------------------------

@dataclass
class Search:
    study: optuna.Study
    study_name: str
    storage_desc: str
    meta: dict[str, Any]
    evaluator: Evaluator
    decoder: TrialDecoder  # trial params <-> key <-> rules (search/decode.py)
    planner: Planner
    driver: Driver
    n_before: int
    notes: list[str]


def _settings(prep: Prepared, cfg: TuneConfig) -> dict[str, Any]:
    """What a study's trials depend on besides the structure (the fingerprint): joining a
    study made under other settings would reuse errors and times that do not hold here."""
    here = prep.source is not None and prep.source.how != "stored profile"  # priced as measured
    return json.loads(json.dumps({
        **({"profile": prep.cost.profile.to_dict()} if here else {}),
        "target": cfg.target, "batch_size": prep.deploy_bs, "budget": cfg.budget,
        "budget_kind": cfg.budget_name, "precisions": list(cfg.precisions),
        "locked": sorted(cfg.locked), "min_speedup": cfg.min_speedup,
        "data": data_hash(prep.calib), "weights": weights_hash(prep.net),
        "code": code_hash(prep.spec, prep.net), "search": 2,
        **({"mode": cfg.mode} if cfg.compile else {}),  # eager studies keep their names
        **({"form": cfg.form} if cfg.form != "train" else {}),  # and train-form ones
        **({"max_weight_mb": cfg.max_weight_mb} if cfg.max_weight_mb is not None else {}),
        # a 16-bit model's errors are against itself (fp32 models keep their study names)
        **({"reference": prep.reference.to_dict()} if not prep.reference.is_fp32 else {}),
    }))


def open_study(prep: Prepared, space: SearchSpace, cfg: TuneConfig, sampler: PlanSampler
               ) -> tuple[optuna.Study, str, str, dict[str, Any], list[str]]:
    settings = _settings(prep, cfg)
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    name = cfg.study_name if cfg.study_name is not None else (
        f"{prep.spec.name}-{cfg.target}-{cfg.budget_name}{cfg.budget:g}-{tag}")
    default_db = prep.out_path.parent / "studies" / f"{prep.spec.name}.db"
    shown = describe_storage(cfg.storage or f"sqlite:///{default_db}")
    meta = study_meta(space, model=prep.spec.name, fingerprint=prep.graph.fingerprint,
                      target=cfg.target, batch_size=prep.deploy_bs, budget=cfg.budget,
                      budget_kind=cfg.budget_name, min_speedup=cfg.min_speedup,
                      seed=cfg.seed, data=settings["data"], locked_paths=list(cfg.locked),
                      settings=settings, form=cfg.form)
    notes = []
    with storage_errors(shown):  # a read-only or full study storage: one line, exit 2
        study = join_study(open_storage(cfg.storage, default_db), name,
                           fingerprint=prep.graph.fingerprint,
                           directions=["minimize", "minimize"] if cfg.pareto else ["minimize"],
                           sampler=sampler)
        fresh = META_KEY not in study.user_attrs
        if fresh:
            study.set_user_attr(META_KEY, meta)
    if not fresh:
        old = study.user_attrs[META_KEY].get("settings", {})
        for key in dict.fromkeys([*settings, *old]):  # a key only one side has counts too
            value = settings.get(key)
            if old.get(key) != value:
                raise InputError(f"study {name!r} in {shown} was tuned with other settings "
                                 f"({key}: {old.get(key)!r} there, {value!r} now); use "
                                 "another --study-name")
        n = len(study.trials)
        if n and not cfg.resume:
            notes.append(f"joined study {name!r} in {shown}: it already holds {n} trials, "
                         f"which this run reuses and adds up to {cfg.trials} to (--resume "
                         "runs until the study holds --trials)")
    return study, name, shown, meta, notes


def run_search(prep: Prepared, space: SearchSpace, cfg: TuneConfig, tracker: Tracker,
               interrupted: list[bool]) -> Search:
    estimate = prep.table.estimate if prep.table is not None else None
    planner = Planner(space, prep.cost, estimate, budget=cfg.budget, margin=MARGIN,
                      prune=not cfg.use_metric)
    sampler = PlanSampler(space, planner, pareto=cfg.pareto, seed=cfg.seed,
                          patience=cfg.patience)
    study, name, shown, meta, notes = open_study(prep, space, cfg, sampler)
    n_before = len(study.trials)
    decoder = TrialDecoder(space, prep.cost)
    evaluator = Evaluator(decoder=decoder, spec=prep.spec, model=prep.net, batches=prep.calib, ref=prep.ref,
                          plans=planner.ps, budget=cfg.budget, target=cfg.target,
                          min_speedup=cfg.min_speedup,
                          eval_batches=None if prep.same_data else prep.eval_batches,
                          eval_ref=None if prep.same_data else prep.eval_ref,
                          exact=reference_key(space, prep.reference))
    if cfg.train_aware:
        evaluator.extra_check = _train_check(prep.spec)
    to_run = max(cfg.trials - count_finished(study), 0) if cfg.resume else cfg.trials
    parent = tracker.start(
        name=f"{name} #{n_before}" if n_before else name,
        params={"model": prep.spec.name, "budget": cfg.budget, "budget_kind": cfg.budget_name,
                "target": cfg.target, "batch_size": prep.deploy_bs, "seed": cfg.seed,
                "form": cfg.form,
                "trials": cfg.trials, "pareto": cfg.pareto,
                "precisions": ",".join(cfg.precisions), "layers": len(space.layers),
                "variables": len(space.variables), "fingerprint": prep.graph.fingerprint,
                "candidates": planner.method},
        tags={"autoprec.study": name, "autoprec.model": prep.spec.name,
              "autoprec.storage": shown})
    meta["mlflow_run"] = parent
    bar = tqdm(total=to_run, desc=f"tune {prep.spec.name}", unit="trial",
               disable=not cfg.progress, leave=False)
    on_trial = _progress(bar, tracker, name)

    driver = Driver(study, space, evaluator, sampler, pareto=cfg.pareto, trials=to_run,
                    timeout=cfg.timeout, on_trial=on_trial,
                    compact=decoder.compact)
    status = "FAILED"
    try:
        with _graceful_interrupt(driver, interrupted), storage_errors(shown):
            driver.run()
        status = "KILLED" if interrupted else "FINISHED"
    finally:
        if driver.complete and not interrupted:
            # the walk ended before --trials: say so, not a bar frozen at "1/40 [2%]"
            bar.total = bar.n
            bar.set_description_str(f"tune {prep.spec.name}: search complete "
                                    f"({planner.priced} plans priced, "
                                    f"{len(driver.by_key)} measured)")
            bar.refresh()
        bar.close()
        if status != "FINISHED":
            tracker.finish(status)
    if interrupted:  # finished trials are in the study; --resume goes on from them
        raise KeyboardInterrupt
    return Search(study, name, shown, meta, evaluator, decoder, planner, driver, n_before,
                  notes)


def _progress(bar: Any, tracker: Tracker, study_name: str) -> Any:
    """The per-trial callback: the progress bar shows the best plan's speed-up and error;
    every trial, measured or pruned, is a child run in MLflow."""
    best: dict[str, float] = {}

    def on_trial(res: TrialResult) -> None:
        ev = res.evaluation
        if ev is not None and ev.feasible and ev.est_speedup > best.get("speedup", 0.0):
            best.update(speedup=ev.est_speedup, error=ev.error)
        bar.update(1)
        if best:
            bar.set_postfix(best=f"{best['speedup']:.2f}x", err=f"{best['error']:.2g}")
        tags = {"autoprec.study": study_name}
        if ev is None:
            tags.update({"autoprec.state": "PRUNED",
                         "autoprec.skipped": (res.skipped or "not measured")[:250]})
            tracker.log_trial(res.number, dict(res.params), {}, tags)
            return
        # one vocabulary with the policy file: `error` is on the held-out (eval) data, where
        # the budget binds (confirmed trials only); `calibration_error` is what the search
        # scores
        tracker.log_trial(res.number, dict(res.params),
                          {"calibration_error": min(ev.error, 1e30), "est_time": ev.est_time,
                           "est_speedup": ev.est_speedup, "feasible": float(ev.feasible),
                           **({} if ev.eval_error is None
                              else {"error": min(ev.eval_error, 1e30)})}, tags)

    return on_trial


@contextlib.contextmanager
def _graceful_interrupt(driver: Driver, hit: list[bool]) -> Iterator[None]:
    """First Ctrl-C (or SIGTERM): stop after the running trial (an interrupt inside Optuna's
    own bookkeeping can leave a trial half-recorded); the second one aborts at once. Only
    the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        if hit:
            raise KeyboardInterrupt
        hit.append(True)
        driver.sampler.end(driver.study, "interrupted")
        what = "" if signum == signal.SIGINT else " (SIGTERM)"
        print(f"autoprec: interrupted{what}; finishing the running trial (again to abort)",
              file=sys.stderr)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _train_check(spec: ModelSpec) -> Any:
    """--train-aware: a plan within budget must also train like fp32 (autoprec.train)."""
    from autoprec.train import fidelity_check_spec

    def check(policy: Policy) -> tuple[bool, dict[str, Any]]:
        report = fidelity_check_spec(spec, policy)
        return not report.diverged, {"reasons": list(report.reasons)}

    return check


# -- stages 4 and 5: select and write -----------------------------------------------------

def _provenance(search: Search, cfg: TuneConfig) -> dict[str, Any]:
    return {
        "autoprec": autoprec.__version__, "torch": str(torch.__version__),
        "optuna": optuna.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seed": cfg.seed, "sampler": "PlanSampler", "candidates": search.planner.method,
        "study": search.study_name, "storage": search.storage_desc,
        "data": search.meta["data"], "mlflow_run": search.meta.get("mlflow_run"),
    }


def write(prep: Prepared, space: SearchSpace, search: Search, cfg: TuneConfig,
          tracker: Tracker, started: float) -> TuneResult:
    cands = select.completed(search.study)
    given = _given_candidate(prep, space)
    if given is not None and not any(c.calib.feasible for c in cands):
        # a 16-bit model: the model as given is within budget by definition (error 0), so
        # a search whose trials all failed or went over budget still writes it
        search.notes.append("no trial found a plan within budget; wrote the model as given "
                            f"({prep.reference.label()})")
        cands = [*cands, given]
    if not cands:
        raise search.driver.nothing_measured(search.study_name)
    chosen, feasible = select.choose(cands, budget=cfg.budget, min_speedup=cfg.min_speedup)
    provenance = _provenance(search, cfg)
    # the last step: the chosen plan beside its baselines, timed when the target is here
    speed, chosen, rules = confirm_tune(prep, space, search, cfg, cands, chosen, feasible,
                                        prep.source)
    if prep.source is not None:
        provenance.update(prep.source.provenance())
    policy = policy_from_candidate(space, chosen, feasible=feasible, eval_error=chosen.eval_error,
                                   meta=search.meta, provenance=provenance, rules=rules)
    policy.target["batch_size"] = prep.deploy_bs
    if chosen.policy and chosen.policy.get("form"):  # a baseline of another form won
        policy.form = chosen.policy["form"]
    if cfg.compile:
        policy.target["mode"] = "compile"
    bd = prep.cost.breakdown(policy)
    policy.metrics.update({"est_casts": bd.casts, "weight_bytes": prep.cost.weight_bytes(policy),
                           **speed_metrics(speed)})
    if not prep.reference.is_fp32:  # est_speedup stays over fp32 (DESIGN); this one over
        policy.reference = prep.reference.to_dict()  # the model as the user has it
        given = prep.cost.estimate(given_policy(prep.reference))
        mine = prep.cost.estimate(policy)
        policy.metrics["est_speedup_over_reference"] = (
            round(given / mine, 4) if 0 < mine < float("inf") else 0.0)
    if cfg.max_weight_mb is not None:
        policy.metrics["weight_budget_mb"] = cfg.max_weight_mb
    if chosen.number < 0:  # a baseline won the measurement: no trial of the study
        policy.provenance["trial"] = None
    if chosen.calib.train_fidelity is not None:
        policy.metrics["train_fidelity"] = chosen.calib.train_fidelity
    _note_headroom(prep, policy)
    policy.save(prep.out_path)
    remove_stale_fronts(prep.out_path)  # an earlier --pareto run's front files are not this run's
    front_pols, front_paths = _write_front(prep, space, search, cfg, cands, provenance)
    eval_error = chosen.eval_error if chosen.eval_error is not None else chosen.calib.error
    rows = trial_rows(search.study)
    sens = prep.table.to_frame() if prep.table is not None else None
    tracker.log_metrics({"error": min(eval_error, 1e30),  # held-out, as in the policy
                         "calibration_error": min(chosen.calib.error, 1e30),
                         "est_speedup": chosen.calib.est_speedup, "feasible": float(feasible),
                         **{k: v for k, v in policy.metrics.items()
                            if k in ("measured_speedup", "weight_bytes", "min_headroom")},
                         "evaluations": search.evaluator.evaluations,
                         "trials": search.driver.ran})
    import pandas as pd

    plans = _plot_plans(prep, search, speed, chosen)
    log_tune_artifacts(tracker, policy_path=prep.out_path, sensitivity=sens,
                       trials=pd.DataFrame(rows), layers=_per_layer(prep, space, policy),
                       chosen_trial=chosen.number, budget=cfg.budget,
                       workdir=prep.out_path.parent / ".autoprec" / search.study_name,
                       plans=plans)
    for p in front_paths:
        tracker.log_artifact(p, "front")
    tracker.finish("FINISHED")
    return TuneResult(policy=policy, path=prep.out_path, feasible=feasible,
                      error=chosen.calib.error, eval_error=eval_error,
                      est_speedup=chosen.calib.est_speedup, budget=cfg.budget,
                      study_name=search.study_name, storage=search.storage_desc,
                      trials=search.driver.ran, evaluations=search.evaluator.evaluations,
                      seconds=time.monotonic() - started, front=front_pols,
                      front_paths=front_paths, trials_table=rows, sensitivity=sens,
                      graph=prep.graph, notes=search.notes + _launch_note(prep, space, cfg)
                      + _one_liner_note(prep, policy, speed)
                      + ([prep.source.note] if prep.source is not None else [])
                      + ([f"priced with this model's ops {prep.source.describe_op_times()}"]
                         if prep.source is not None and prep.source.timed else []),
                      complete=search.driver.complete, method=search.planner.method,
                      speed=speed, priced=search.planner.priced,
                      measured=len(search.driver.by_key), plot_plans=plans,
                      reference=prep.reference, weight_bytes=prep.reference.weight_bytes)


def _given_candidate(prep: Prepared, space: SearchSpace) -> select.Candidate | None:
    """The model as given (a 16-bit model's own layout) as a candidate (no trial of the
    study): error 0, priced like every plan. None for an fp32 model."""
    from autoprec.search.evaluation import Evaluation

    refm = prep.reference
    if refm.is_fp32 or refm.islands:  # a mixed model's own layout is measured (reference_key)
        return None
    pol = given_policy(refm)
    t = prep.cost.estimate(pol)
    key = reference_key(space, refm) or space.uniform(refm.default)
    return select.Candidate(number=-1, params=space.params(key),
                            calib=Evaluation(0.0, t, prep.cost.fp32_time / t if t > 0 else 0.0,
                                             True, eval_error=0.0),
                            policy={"default": refm.default, "layers": refm.rules(),
                                    "form": "deploy"})


def _plot_plans(prep: Prepared, search: Search, speed: Any, chosen: Any) -> PlotPlans:
    """pareto.png's alternatives: every plan the planner priced (its predicted error, as
    corrected by the measured ones; not for a metric budget, whose units the predictions
    do not share), fp32 and the one-liners as the last step scored them, the chosen plan."""
    import pandas as pd

    planner = search.planner
    priced = None
    if planner.prune and len(planner.times):
        priced = (planner.preds * planner.correction, prep.cost.fp32_time / planner.times)
    rows = [{"plan": r.name, "error": r.error, "est_speedup": r.est_speedup}
            for r in (speed.rows if speed is not None else [])
            if r.role == "baseline" and r.error is not None and r.est_speedup is not None]
    return PlotPlans(priced=priced, baselines=pd.DataFrame(rows) if rows else None,
                     chosen=(chosen.calib.error, chosen.calib.est_speedup))


def _note_headroom(prep: Prepared, policy: Policy) -> None:
    """The winner's headroom (probe.headroom: one fp32 pass over the calibration data):
    ``metrics.min_headroom`` (and its layer), and a reason for each layer under
    NOTE_BELOW — what a reviewer reads before choosing ``guard`` layers."""
    from autoprec.fused import fused_paths_off
    from autoprec.plan import compile_plan
    from autoprec.policy import gemm_leaf_paths
    from autoprec.probe.headroom import NOTE_BELOW, measure_headroom, smallest

    res = compile_plan(policy, prep.net).resolution()
    with fused_paths_off():
        rows = measure_headroom(prep.net, prep.calib, prep.spec.forward,
                                {p: (res[p].precision, res[p].region)
                                 for p in gemm_leaf_paths(prep.net) if p in res})
    low = smallest(rows)
    if low is None or not math.isfinite(low.headroom):
        return
    policy.metrics["min_headroom"] = round(low.headroom, 4)
    policy.metrics["min_headroom_layer"] = low.layer
    for r in rows:
        if r.headroom < NOTE_BELOW:
            had = policy.reasons.get(r.layer)
            policy.reasons[r.layer] = f"{had}; {r.note()}" if had else r.note()


def _per_layer(prep: Prepared, space: SearchSpace, policy: Policy) -> dict[str, str]:
    """The precision every GEMM layer computes in under ``policy`` (not only the layers
    with a rule: the default's too), in the model's order — for the layers plot."""
    from autoprec.plan import compile_plan

    return compile_plan(policy, prep.net).assignment(space.layers)


def _write_front(prep: Prepared, space: SearchSpace, search: Search, cfg: TuneConfig,
                 cands: list[select.Candidate], provenance: dict[str, Any]
                 ) -> tuple[list[Policy], list[Path]]:
    if not cfg.pareto:
        return [], []
    out = prep.out_path
    pols, paths = [], []
    for i, c in enumerate(select.pareto_front(cands)):
        rules = search.decoder.rules(c)
        fp = policy_from_candidate(space, c, feasible=c.calib.feasible, eval_error=c.eval_error,
                                   meta=search.meta, provenance=provenance, rules=rules)
        path = out.with_name(f"{out.stem}.front{i}{out.suffix}")
        fp.save(path)
        pols.append(fp)
        paths.append(path)
    return pols, paths


#: Estimates this close (relative) read as "the same speed" to a person.
SAME_SPEED = 0.005


def _one_liner_note(prep: Prepared, policy: Policy, speed: Any) -> list[str]:
    """A policy with rules estimated as fast as a one-line baseline within budget: say why
    the one line is not the same plan (compaction would have written it otherwise) — which
    modules it would put in another precision."""
    if not policy.layers or speed is None:
        return []
    est = policy.metrics.get("est_speedup")
    for row in speed.rows:
        if (row.role != "baseline" or row.policy is None or not row.feasible
                or row.est_speedup is None or est is None
                or abs(row.est_speedup - est) > SAME_SPEED * est):
            continue
        base = row.policy.default
        diff = compact.differences(prep.cost, (policy.default, policy.layers), (base, {}))
        if not diff:
            continue
        where = ", ".join(f"{_module_words(prep, p)} ({a} here)" for p, a, _b in diff[:4])
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        return [f"the one line `default: {base}` ({row.name}) is estimated as fast "
                f"({row.est_speedup:.2f}x) but is not the same plan, so it is not what was "
                f"written: it would also run {where}{more} in {base}"]
    return []


def _module_words(prep: Prepared, path: str) -> str:
    if not path:
        return "the model's own code"
    if path in {n.path for n in prep.graph.gemm_nodes}:
        return path
    return f"the ops of {path} outside its GEMM layers"


def _launch_note(prep: Prepared, space: SearchSpace, cfg: TuneConfig) -> list[str]:
    """The calibration batch is launch-bound on a GPU: every precision prices the same."""
    if cfg.batch_size is not None:
        return []
    best = max(prep.cost.speedup(Policy(default=p)) for p in space.region.choices)
    if best >= LAUNCH_BOUND:
        return []
    return [f"at the calibration batch size ({prep.calib_bs}) the forward is launch-bound on "
            f"{cfg.target}: no precision is estimated more than {best:.2f}x faster than "
            "fp32; give the deployment batch with --batch-size N"]


def tune(model: str | Path | ModelSpec, config: TuneConfig | None = None, *,
         tracker: Tracker | None = None, profile: Any = None, **options: Any) -> TuneResult:
    """Find the fastest plan within the budget and write it as a policy.

    ``config``: a ``TuneConfig`` (search/config.py: every option, validated once; the CLI
    builds one), or its fields as keywords (``tune(model, max_error=0.01, trials=20)``).
    ``trials`` is the number of trials this process runs at most (the search stops sooner
    once nothing faster is predicted within budget, or after ``patience`` trials without a
    faster plan); ``resume=True``: run until the study holds that many finished trials.
    ``tracker``: None logs nothing (the CLI's default is MLflow in ./mlflow.db:
    ``autoprec.track.make_tracker``). ``measure`` (a target that is this machine: ``cpu``,
    or the GPU here): price on a profile calibrated here and time the winner beside fp32
    and one global autocast, never writing a plan measured slower
    (``search/confirm_speed.py``). ``report``: a folder to write the tables and plots into
    (trials, Pareto front, per-layer precisions, and the tuned plan beside one global
    autocast per precision), MLflow or not. ``compile=True`` prices every plan as
    ``torch.compile`` runs it (cost/fusion.py) and records ``target.mode: compile`` (the
    measured confirmation times eager forwards, so it is skipped then); ``profile``: a
    DeviceProfile to price with (e.g. calibrated here) instead of ``target``'s.
    ``memory_limit_gb``: the device's memory for the up-front check that the model fits
    twice (``autoprec.memory``; default: what the device reports). The model as given is
    the reference (``autoprec.reference``): a bf16 model's errors are against its own
    outputs and its policy records ``reference:``.
    See DESIGN.md for the contract.
    """
    started = time.monotonic()
    if config is not None and options:
        raise TypeError(f"tune: give a TuneConfig or its options, not both (got config and "
                        f"{', '.join(sorted(options))})")
    cfg = (config if config is not None else TuneConfig(**options)).validated()
    tracker = tracker or NullTracker()
    peaks = StagePeaks()
    prep = prepare(model, cfg, profile, peaks)
    with peaks.stage("search"):
        space = make_space(prep, cfg)
        interrupted: list[bool] = []
        search = run_search(prep, space, cfg, tracker, interrupted)
    with peaks.stage("confirm"):  # select, confirm on the eval data, write
        result = write(prep, space, search, cfg, tracker, started)
    release_freed()
    if cfg.report is not None:
        from autoprec.search.baselines import write_report

        result.report = write_report(Path(cfg.report), result, list(space.region.choices),
                                     _per_layer(prep, space, result.policy))
    result.peak_memory, result.peak_memory_how = peak_bytes(prep.net)
    # the per-stage resets reset ru_maxrss too (Linux): the peak is the highest stage's
    result.peak_memory = max(result.peak_memory, peaks.overall)
    result.memory_stages = dict(peaks.peaks)
    return result



__all__ = ["TuneConfig", "TuneResult", "tune"]  # TuneConfig: search/config.py
