"""``tune``: from a model.py to a policy file — the stages wired together.

load -> trace -> probe -> cost -> space -> Optuna (planned trials, then the sampler) ->
choose and confirm on eval data -> Policy (+ Pareto front) -> MLflow.
This module orchestrates; the numerics live in the stages it calls.
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from tqdm.auto import tqdm

import autoprec
from autoprec.cost import CostModel, get_profile
from autoprec.errors import InputError
from autoprec.evaluate import reference, score
from autoprec.hashing import code_hash, data_hash, weights_hash
from autoprec.loading import ModelSpec, load_model_file
from autoprec.metrics import batch_size_of
from autoprec.paths import check_out_path, remove_stale_fronts
from autoprec.policy import Policy
from autoprec.precisions import PRECISIONS, check_precision
from autoprec.probe import probe
from autoprec.search import select, strategy, walk
from autoprec.search.driver import Driver, TrialResult, make_sampler, trial_rows
from autoprec.search.export import META_KEY, policy_from_candidate, study_meta
from autoprec.search.objective import SCREEN_FACTOR, Evaluator
from autoprec.search.space import SearchSpace, build_space
from autoprec.search.storage import count_finished, describe_storage, join_study, open_storage
from autoprec.trace import trace
from autoprec.trace.graph import LayerGraph
from autoprec.track import NullTracker, Tracker, log_tune_artifacts
from autoprec.validate import check_tune_args

DEFAULT_MAX_ERROR = 0.01


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


def _check_budget(max_error: float | None, max_drop: float | None) -> tuple[float, str]:
    if max_error is not None and max_drop is not None:
        raise InputError("give --max-error or --max-drop, not both")
    value, name = (max_drop, "max_drop") if max_drop is not None else (
        DEFAULT_MAX_ERROR if max_error is None else max_error, "max_error")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InputError(f"--{name.replace('_', '-')}: must be a finite number, got {value!r}")
    if value < 0:
        raise InputError(f"--{name.replace('_', '-')}: must be >= 0, got {value}")
    return float(value), name


def _space(graph: LayerGraph, table: Any, profile: Any, precisions: Sequence[str],
           locked: Sequence[str]) -> SearchSpace:
    """Choices per GEMM layer: graph eligibility ∩ target device ∩ probes' hard facts."""
    device_ok = {}
    device_why = {}
    for p in PRECISIONS:
        ok, why = profile.supports(p)
        device_ok[p] = ok
        if not ok:
            device_why[p] = why
    hard = table.hard_excluded() if table is not None else {}
    layers, allowed, excluded = [], {}, {}
    for node in graph.gemm_nodes:
        if not node.is_leaf and node.kind not in ("attention", "matmul"):
            continue
        layers.append(node.path)
        why_not = {p: r for p, r in node.disallowed.items() if p in precisions}
        for p in precisions:
            if not device_ok[p]:
                why_not.setdefault(p, device_why[p])
            if (node.path, p) in hard:
                why_not.setdefault(p, hard[(node.path, p)])
        allowed[node.path] = [p for p in node.allowed if p in precisions and p not in why_not]
        excluded[node.path] = why_not
    return build_space(layers, allowed, excluded, precisions, locked=locked)


def tune(
    model: str | Path | ModelSpec,
    *,
    max_error: float | None = None,
    max_drop: float | None = None,
    target: str = "h100",
    batch_size: int | None = None,
    precisions: Sequence[str] | None = None,
    trials: int = 40,
    timeout: float | None = None,
    seed: int = 0,
    patience: int | None = None,
    min_speedup: float | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    resume: bool = False,
    pareto: bool = False,
    out: str | Path | None = None,
    locked: Sequence[str] = (),
    tracker: Tracker | None = None,
    progress: bool = True,
    cache_dir: str | Path | None = None,
    plan: bool = True,
    train_aware: bool = False,
) -> TuneResult:
    """Find the fastest per-layer assignment within the budget and write it as a policy.

    ``trials`` is the number of trials this process runs (``resume=True``: run until the
    study holds that many finished trials). See DESIGN.md for the contract.
    """
    started = time.monotonic()
    check_tune_args(max_error=max_error, max_drop=max_drop, target=target, batch_size=batch_size,
                    trials=trials, timeout=timeout, seed=seed, patience=patience,
                    min_speedup=min_speedup, storage=storage, study_name=study_name, out=out,
                    cache_dir=cache_dir)  # before any work (autoprec.validate)
    budget, budget_name = _check_budget(max_error, max_drop)
    if train_aware and not isinstance(model, ModelSpec):
        model = load_model_file(model)
    if train_aware and model.loss is None:  # type: ignore[union-attr]
        raise InputError(f"{model.path}: --train-aware needs loss(outputs, batch) in model.py")  # type: ignore[union-attr]
    if trials < 1:
        raise InputError(f"--trials: must be >= 1, got {trials}")
    if patience is not None and patience < 1:
        raise InputError(f"--patience: must be >= 1 trial, got {patience}")
    if study_name is not None and not study_name.strip():
        raise InputError("--study-name: must not be empty")
    if timeout is not None and timeout <= 0:
        raise InputError(f"--timeout: must be > 0 seconds, got {timeout}")
    if batch_size is not None and batch_size < 1:
        raise InputError(f"--batch-size: must be >= 1, got {batch_size}")
    if min_speedup is not None and not min_speedup > 0:
        raise InputError(f"--min-speedup: must be > 0, got {min_speedup}")
    profile = get_profile(target)  # unknown target -> InputError
    spec = model if isinstance(model, ModelSpec) else load_model_file(model)
    if budget_name == "max_drop" and spec.metric is None:
        raise InputError(f"{spec.path}: --max-drop needs a metric(outputs, batch) in model.py")
    if budget_name == "max_error" and max_error is not None and spec.metric is not None:
        pass  # relative L2 of the outputs even though a metric exists: the user asked for it
    wanted = tuple(check_precision(p, "--precisions") for p in (precisions or PRECISIONS))
    wanted = tuple(p for p in PRECISIONS if p in wanted or p == "fp32")
    tracker = tracker or NullTracker()

    net = spec.model()
    calib = spec.calibration_batches()
    eval_batches = spec.eval_batches()
    same_data = spec.eval_data is None
    calib_bs = batch_size_of(calib[0]) or 1
    deploy_bs = batch_size or calib_bs
    out_path = Path(out) if out is not None else Path("policies") / f"{spec.name}-{target}.yaml"
    check_out_path(out_path)  # before any expensive work

    ref = reference(spec, net, calib, "of calibration_data",  # also: the model accepts it
                    need_outputs=budget_name != "max_drop")
    eval_ref = ref if same_data else reference(spec, net, eval_batches, "of eval_data")
    check = score(spec, net, calib, ref, "of calibration_data")
    if check.error != 0.0:
        raise InputError(f"{spec.path}: the fp32 model is not deterministic (two runs differ "
                         f"by {check.error:.3g}); put it in eval mode / fix random ops")

    graph = trace(net, calib[0], forward=spec.forward, model_name=spec.name)
    unknown = [lk for lk in locked if lk not in graph]
    if unknown:
        raise InputError(f"--lock {unknown[0]!r}: {spec.path} has no such module")
    if cache_dir is None:  # probe results are reused across tunes of the same model + data
        cache_dir = out_path.parent / ".autoprec" / "probe-cache"
    use_metric = budget_name == "max_drop"
    # Gradient probes (model.py's loss) cost ~20 forward-equivalents; only training needs them.
    table = probe(net, calib, precisions=[p for p in wanted if p != "fp32"],
                  forward=spec.forward, loss=spec.loss if train_aware else None,
                  metric=spec.metric if use_metric else None,
                  graph=graph, budget=budget,
                  cache_dir=cache_dir, progress=progress)
    cost = CostModel(graph, profile, batch_size=deploy_bs)
    space = _space(graph, table, profile, wanted, locked)
    if not any(len(v.choices) > 1 for v in space.variables):
        why = sorted({w for v in space.variables for w in v.excluded.values()})
        raise InputError(
            f"nothing to tune: no layer of {spec.name} may take "
            f"{', '.join(p for p in wanted if p != 'fp32') or 'a precision below fp32'} on "
            f"{target}" + (f" ({'; '.join(why)[:300]})" if why else ""))
    if not use_metric and spec.metric is not None:
        spec = _without_metric(spec)  # the budget is on relative L2: score that
    evaluator = Evaluator(spec=spec, model=net, batches=calib, ref=ref, cost=cost,
                          space=space, budget=budget, min_speedup=min_speedup)

    # -- the study --------------------------------------------------------------------------
    default_db = out_path.parent / "studies" / f"{spec.name}.db"
    store = open_storage(storage, default_db)
    # What a study's trials depend on besides the structure (the fingerprint): joining a
    # study made under other settings would reuse errors and times that do not hold here.
    settings = json.loads(json.dumps({
        "target": target, "batch_size": deploy_bs, "budget": budget,
        "budget_kind": budget_name, "precisions": list(wanted), "locked": sorted(locked),
        "min_speedup": min_speedup, "data": data_hash(calib), "weights": weights_hash(net),
        "code": code_hash(spec, net),
    }))
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    study_name = study_name if study_name is not None else (
        f"{spec.name}-{target}-{budget_name}{budget:g}-{tag}")
    study = join_study(store, study_name, fingerprint=graph.fingerprint,
                       directions=["minimize", "minimize"] if pareto else ["minimize"],
                       sampler=make_sampler(pareto, seed))
    n_before = len(study.trials)
    meta = study_meta(space, model=spec.name, fingerprint=graph.fingerprint, target=target,
                      batch_size=deploy_bs, budget=budget, budget_kind=budget_name,
                      min_speedup=min_speedup, seed=seed, data=settings["data"],
                      locked_paths=list(locked))
    meta["settings"] = settings
    if META_KEY not in study.user_attrs:
        study.set_user_attr(META_KEY, meta)
    else:
        old = study.user_attrs[META_KEY].get("settings", {})
        for key, value in settings.items():
            if old.get(key) != value:
                raise InputError(
                    f"study {study_name!r} in {describe_storage(storage or f'sqlite:///{default_db}')} "
                    f"was tuned with other settings ({key}: {old.get(key)!r} there, "
                    f"{value!r} now); use another --study-name")
    to_run = max(trials - count_finished(study), 0) if resume else trials

    parent = tracker.start(
        name=study_name,
        params={"model": spec.name, "budget": budget, "budget_kind": budget_name,
                "target": target, "batch_size": deploy_bs, "seed": seed, "trials": trials,
                "pareto": pareto, "precisions": ",".join(wanted),
                "layers": len(space.layers), "variables": len(space.variables),
                "fingerprint": graph.fingerprint},
        tags={"autoprec.study": study_name, "autoprec.model": spec.name,
              "autoprec.storage": describe_storage(storage or f"sqlite:///{default_db}")},
    )
    bar = tqdm(total=to_run, desc=f"tune {spec.name}", unit="trial", disable=not progress,
               leave=False)
    best = {"speedup": 1.0}

    def on_trial(res: TrialResult) -> None:
        ev = res.evaluation
        if ev.feasible and ev.est_speedup > best["speedup"]:
            best["speedup"] = ev.est_speedup
        bar.update(1)
        bar.set_postfix(best=f"{best['speedup']:.2f}x", err=f"{ev.error:.2g}")
        tracker.log_trial(res.number, {k: v for k, v in res.params.items()},
                          {"error": min(ev.error, 1e30), "est_time": ev.est_time,
                           "est_speedup": ev.est_speedup, "feasible": float(ev.feasible)},
                          {"phase": res.phase, "autoprec.study": study_name})

    # Eval-data confirmation, memoised: the planned walk and the final choice share it.
    confirmed: dict[tuple[tuple[str, str], ...], float] = {}

    def confirm_eval(params: Any) -> float:
        key = tuple(sorted(params.items()))
        if key not in confirmed:
            confirmed[key] = evaluator.error(params, eval_batches, eval_ref, "of eval_data")
            evaluator.evaluations += len(eval_batches) / len(calib)
        return confirmed[key]

    confirm = None if same_data else confirm_eval
    driver = Driver(study, space, evaluator, pareto=pareto, trials=to_run, timeout=timeout,
                    patience=patience, on_trial=on_trial,
                    skip=None if pareto else _skipper(space, evaluator, cost, table, use_metric))
    status = "FAILED"
    try:
        with _graceful_interrupt(driver) as interrupted:
            if plan and n_before == 0:  # the first worker of a study plans; later ones sample
                _planned(driver, space, cost, table, evaluator, pareto=pareto,
                         use_metric=use_metric, confirm=confirm)
            driver.run_sampler()
        if interrupted:  # finished trials are in the study; --resume goes on from them
            raise KeyboardInterrupt
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        bar.close()
        if status != "FINISHED":
            tracker.finish(status)

    # -- choose, confirm, write -------------------------------------------------------------
    cands = select.completed(study)
    fidelity: dict[str, Any] = {}
    if train_aware:  # a candidate must also train like fp32 (autoprec.train)
        confirm = _train_confirm(spec, space, evaluator, confirm, fidelity)
    chosen, feasible = select.choose(cands, budget=budget, min_speedup=min_speedup,
                                     confirm=confirm)
    storage_desc = describe_storage(storage or f"sqlite:///{default_db}")
    provenance = {
        "autoprec": autoprec.__version__, "torch": str(torch.__version__),
        "optuna": optuna.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seed": seed, "sampler": type(study.sampler).__name__, "study": study_name,
        "storage": storage_desc, "data": meta["data"], "mlflow_run": parent,
    }
    policy = policy_from_candidate(space, chosen, feasible=feasible,
                                   eval_error=chosen.eval_error, meta=meta,
                                   provenance=provenance)
    trained = fidelity.get(tuple(sorted(chosen.params.items())))
    if trained is not None:  # --train-aware: the short training run agreed with fp32
        policy.metrics["train_fidelity"] = not trained["diverged"]
    eval_error = chosen.eval_error if chosen.eval_error is not None else chosen.calib.error
    policy.save(out_path)
    remove_stale_fronts(out_path)  # an earlier --pareto run's front files are not this run's
    front_pols, front_paths = [], []
    if pareto:
        for i, c in enumerate(select.pareto_front(cands)):
            fp = policy_from_candidate(space, c, feasible=c.calib.feasible, eval_error=None,
                                       meta=meta, provenance=provenance)
            path = out_path.with_name(f"{out_path.stem}.front{i}{out_path.suffix}")
            fp.save(path)
            front_pols.append(fp)
            front_paths.append(path)
    rows = trial_rows(study)
    sens = table.to_frame() if table is not None else None
    tracker.log_metrics({"error": min(chosen.calib.error, 1e30), "eval_error": min(eval_error, 1e30),
                         "est_speedup": chosen.calib.est_speedup, "feasible": float(feasible),
                         "evaluations": evaluator.evaluations, "trials": driver.ran})
    import pandas as pd

    log_tune_artifacts(tracker, policy_path=out_path, sensitivity=sens,
                       trials=pd.DataFrame(rows), layers=policy.layers,
                       chosen_trial=chosen.number, budget=budget,
                       workdir=out_path.parent / ".autoprec" / study_name)
    for p in front_paths:
        tracker.log_artifact(p, "front")
    tracker.finish("FINISHED")
    return TuneResult(policy=policy, path=out_path, feasible=feasible,
                      error=chosen.calib.error, eval_error=eval_error,
                      est_speedup=chosen.calib.est_speedup, budget=budget,
                      study_name=study_name, storage=storage_desc, trials=driver.ran,
                      evaluations=evaluator.evaluations, seconds=time.monotonic() - started,
                      front=front_pols, front_paths=front_paths, trials_table=rows,
                      sensitivity=sens, graph=graph)


@contextlib.contextmanager
def _graceful_interrupt(driver: Driver) -> Iterator[list[bool]]:
    """First Ctrl-C: stop after the running trial (a KeyboardInterrupt inside Optuna's own
    bookkeeping can leave a trial half-recorded); the second one aborts at once. Yields a
    list that holds True once interrupted. Only the main thread can take signals."""
    hit: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield hit
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if hit:
            raise KeyboardInterrupt
        hit.append(True)
        driver.stopped = True
        driver.study.stop()
        print("autoprec: interrupted; finishing the running trial (Ctrl-C again to abort)",
              file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_term = signal.signal(signal.SIGTERM, on_sigint)  # a kill / scheduler stop
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


def _without_metric(spec: ModelSpec) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, metric=None)


#: Best-first evaluates assignments the probes predict within this factor of the budget
#: (the estimate ranks well — Spearman 0.97-0.99 — but is not exact).
MARGIN = 1.25


def _planned(driver: Driver, space: SearchSpace, cost: CostModel, table: Any,
             evaluator: Evaluator, *, pareto: bool, use_metric: bool,
             confirm: Any) -> None:
    """The planned trials: all-fp32 (free), then best-first (single objective) or the
    sensitivity ladder (Pareto: every prefix is a front point)."""
    driver.run_planned(space.uniform("fp32"), "seed:fp32")
    if pareto:
        _ladder(driver, space, cost, table, evaluator)
        return
    timer = walk.SpaceTimer(space, cost)
    estimate = table.estimate if table is not None else (lambda layer, p: 0.0)
    # With a metric the probes' estimates (relative L2) are in other units than the budget:
    # nothing is pruned, the walk simply evaluates fastest-first.
    limit = math.inf if use_metric else MARGIN * evaluator.budget
    conf = None if confirm is None else (lambda params: confirm(params) <= evaluator.budget)
    walk.best_first(space, timer, walk.predictor(space, estimate),
                    lambda params: driver.run_planned(params, "best-first"),
                    limit=limit, confirm=conf)


def _skipper(space: SearchSpace, evaluator: Evaluator, cost: CostModel, table: Any,
             use_metric: bool) -> Any:
    """Sampler proposals not worth a model run: slower than the best feasible trial (the
    cost model knows that without running anything), or hopeless by the probes."""
    timer = walk.SpaceTimer(space, cost)
    predicted = walk.predictor(space, table.estimate) if table is not None else None

    def skip(params: Any, best_time: float) -> tuple[str, float] | None:
        key = timer.key(params)
        guess = predicted(key) if predicted is not None and not use_metric else math.nan
        if evaluator.timing(params)[0] >= best_time:
            return "dominated: not faster than the best feasible trial", guess
        if not use_metric and guess > SCREEN_FACTOR * evaluator.budget:
            return "hopeless: the probes predict error > 3x the budget", guess
        return None

    return skip


def _ladder(driver: Driver, space: SearchSpace, cost: CostModel, table: Any,
            evaluator: Evaluator) -> None:
    """Pareto seeds: uniform precisions, then bisection over the sensitivity-ordered moves
    and a greedy fill: the prefixes spread along the error/speed front."""
    for p in PRECISIONS[1:]:
        if any(p in v.choices for v in space.variables):
            driver.run_planned(space.uniform(p), f"seed:{p}")
    moves = strategy.rank_moves(
        space, lambda params: cost.estimate(space.assignment(params)),
        lambda layer, p: table.estimate(layer, p) if table is not None else 1.0)

    def feasible(k: int) -> bool | None:
        ev = driver.run_planned(strategy.prefix_params(space, moves, k), f"bisect:{k}")
        return None if ev is None else ev.feasible

    k = strategy.bisect_prefix(len(moves), feasible)
    best = strategy.prefix_params(space, moves, k)
    best_time = evaluator.timing(best)[0]
    for m in moves[k:]:  # greedy fill: try each remaining move once
        if driver.exhausted:
            return
        if best.get(m.variable) == m.precision:
            continue
        cand = {**best, m.variable: m.precision}
        t = evaluator.timing(cand)[0]
        if t >= best_time:
            continue
        ev = driver.run_planned(cand, "fill")
        if ev is not None and ev.feasible:
            best, best_time = cand, t


def _train_confirm(spec: ModelSpec, space: SearchSpace, evaluator: Evaluator,
                   confirm: Any, record: dict[str, Any]) -> Any:
    """Wrap the eval-data confirmation with the training-fidelity check: a candidate whose
    short fp32-vs-policy training run diverges counts as over budget."""
    from autoprec.search.objective import policy_for
    from autoprec.train import fidelity_check_spec

    def check(params: Any) -> float:
        err = confirm(params) if confirm is not None else evaluator(params).error
        if not err <= evaluator.budget:
            return err
        policy = policy_for(space.assignment(params), space.default, evaluator.fingerprint)
        report = fidelity_check_spec(spec, policy)
        key = tuple(sorted(params.items()))
        record[key] = {"diverged": report.diverged, "reasons": list(report.reasons)}
        return math.inf if report.diverged else err

    return check
