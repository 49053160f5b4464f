"""tune's stage 3: the search — the planner as an Optuna sampler over a (shared) study.

The planner (search/planner.py) proposes the plans worth measuring, the driver runs the
trials (study/driver.py), each scored by the PlanScorer (study/objective.py) and logged by
the tracker; progress, Ctrl-C (finish the trial, then write) and the study's settings
(what a shared study must agree on) are here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from tqdm.auto import tqdm

from autoprec.errors import InputError, TuneInterrupted
from autoprec.search.decode import TrialDecoder
from autoprec.search.planner import Planner
from autoprec.search.space import SearchSpace
from autoprec.study.driver import Driver, TrialResult
from autoprec.study.export import META_KEY, study_meta
from autoprec.study.objective import PlanScorer
from autoprec.study.sampler import PlanSampler
from autoprec.study.storage import (
    count_finished,
    describe_storage,
    join_study,
    open_storage,
    storage_errors,
)
from autoprec.track import Tracker
from autoprec.training.short_run import ShortRunCheck
from autoprec.tuning.config import TuneConfig
from autoprec.tuning.prepare import Prepared, reference_key
from autoprec.tuning.train_choice import make_check
from autoprec.workload.hashing import code_hash, data_hash, weights_hash

#: The walk measures plans whose corrected prediction is within this factor of the budget.
MARGIN = 1.25


# -- stage 3: the search ------------------------------------------------------------------

@dataclass
class Search:
    study: optuna.Study
    study_name: str
    storage_desc: str
    meta: dict[str, Any]
    scorer: PlanScorer  # scores each plan the search runs (study/objective.py)
    decoder: TrialDecoder  # trial params <-> key <-> rules (search/decode.py)
    planner: Planner
    driver: Driver
    n_before: int
    notes: list[str]
    #: --train-aware: the short-run contract the written plan must pass (train_choice.py)
    train_check: ShortRunCheck | None = None


def _settings(prep: Prepared, cfg: TuneConfig) -> dict[str, Any]:
    """What a study's trials depend on besides the structure (the fingerprint): joining a
    study made under other settings would reuse errors and times that do not hold here."""
    here = prep.target.speed.how != "stored profile"  # priced as measured
    pricing = cfg.pricing
    return json.loads(json.dumps({
        **({"profile": prep.cost.profile.to_dict()} if here else {}),
        "target": cfg.pricing.target, "batch_size": prep.deploy_bs, "budget": cfg.budget.value,
        "budget_kind": cfg.budget.name, "precisions": list(cfg.search.precisions),
        "locked": sorted(cfg.search.locked), "min_speedup": cfg.search.min_speedup,
        "data": data_hash(prep.calib), "weights": weights_hash(prep.net),
        "code": code_hash(prep.spec, prep.net), "search": 2,
        # eager studies keep their names, and train-form ones
        **({"mode": prep.target.mode} if pricing.compile else {}),
        **({"form": pricing.form} if pricing.form != "train" else {}),
        **({"max_weight_mb": pricing.max_weight_mb} if pricing.max_weight_mb is not None
           else {}),
        # a 16-bit model's errors are against itself (fp32 models keep their study names)
        **({"reference": prep.reference.to_dict()} if not prep.reference.is_fp32 else {}),
    }))


def open_study(prep: Prepared, space: SearchSpace, cfg: TuneConfig, sampler: PlanSampler
               ) -> tuple[optuna.Study, str, str, dict[str, Any], list[str]]:
    settings = _settings(prep, cfg)
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    name = cfg.study.study_name if cfg.study.study_name is not None else (
        f"{prep.spec.name}-{cfg.pricing.target}-{cfg.budget.name}{cfg.budget.value:g}-{tag}")
    default_db = prep.out_path.parent / "studies" / f"{prep.spec.name}.db"
    shown = describe_storage(cfg.study.storage or f"sqlite:///{default_db}")
    meta = study_meta(space, model=prep.spec.name, fingerprint=prep.graph.fingerprint,
                      target=cfg.pricing.target, batch_size=prep.deploy_bs, budget=cfg.budget.value,
                      budget_kind=cfg.budget.name, min_speedup=cfg.search.min_speedup,
                      seed=cfg.search.seed, data=settings["data"],
                      locked_paths=list(cfg.search.locked),
                      settings=settings, form=cfg.pricing.form)
    notes = []
    with storage_errors(shown):  # a read-only or full study storage: one line, exit 2
        study = join_study(open_storage(cfg.study.storage, default_db), name,
                           fingerprint=prep.graph.fingerprint,
                           directions=["minimize"] * (2 if cfg.search.pareto else 1),
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
        if n and not cfg.study.resume:
            notes.append(f"joined study {name!r} in {shown}: it already holds {n} trials, "
                         f"which this run reuses and adds up to {cfg.search.trials} to (--resume "
                         "runs until the study holds --trials)")
    return study, name, shown, meta, notes


def run_search(prep: Prepared, space: SearchSpace, cfg: TuneConfig, tracker: Tracker,
               interrupted: list[bool]) -> Search:
    estimate = prep.table.estimate if prep.table is not None else None
    planner = Planner(space, prep.cost, estimate, budget=cfg.budget.value, margin=MARGIN,
                      prune=not cfg.budget.use_metric)
    sampler = PlanSampler(space, planner, pareto=cfg.search.pareto, seed=cfg.search.seed,
                          patience=cfg.search.patience)
    study, name, shown, meta, notes = open_study(prep, space, cfg, sampler)
    n_before = len(study.trials)
    decoder = TrialDecoder(space, prep.cost)
    scorer = PlanScorer(decoder=decoder, spec=prep.spec, model=prep.net, batches=prep.calib,
                        ref=prep.ref, plans=planner.ps, budget=cfg.budget.value, target=prep.target,
                        min_speedup=cfg.search.min_speedup,
                        eval_batches=None if prep.same_data else prep.eval_batches,
                        eval_ref=None if prep.same_data else prep.eval_ref,
                        exact=reference_key(space, prep.reference))
    trials = cfg.search.trials
    to_run = max(trials - count_finished(study), 0) if cfg.study.resume else trials
    parent = tracker.start(
        name=f"{name} #{n_before}" if n_before else name,
        params={"model": prep.spec.name, "budget": cfg.budget.value, "budget_kind": cfg.budget.name,
                "target": cfg.pricing.target, "batch_size": prep.deploy_bs, "seed": cfg.search.seed,
                "form": cfg.pricing.form,
                "trials": cfg.search.trials, "pareto": cfg.search.pareto,
                "precisions": ",".join(cfg.search.precisions), "layers": len(space.layers),
                "variables": len(space.variables), "fingerprint": prep.graph.fingerprint,
                "candidates": planner.method},
        tags={"autoprec.study": name, "autoprec.model": prep.spec.name,
              "autoprec.storage": shown})
    meta["mlflow_run"] = parent
    bar = tqdm(total=to_run, desc=f"tune {prep.spec.name}", unit="trial",
               disable=not cfg.output.progress, leave=False)
    on_trial = _progress(bar, tracker, name)

    driver = Driver(study, space, scorer, sampler, pareto=cfg.search.pareto, trials=to_run,
                    timeout=cfg.search.timeout, on_trial=on_trial,
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
        raise TuneInterrupted(name, shown, count_finished(study))
    # the trials train nothing: the written plan and its one-liners are checked at the end
    return Search(study, name, shown, meta, scorer, decoder, planner, driver, n_before,
                  notes, make_check(prep, cfg))


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


__all__ = ["MARGIN", "Search", "open_study", "run_search"]
