"""``tune``: from a model.py to a policy file, in stages a reader can follow.

    prepare  load the model and data, the up-front memory check, the references (the
             model's own outputs, as given: fp32, bf16, fp16 or mixed), trace (graph + op
             trace), probes, the cost model at the deployment batch size
    space    the default region and one variable per GEMM layer, narrowed by hard facts
    search   the planner (search/planner.py) as an Optuna sampler over a shared study
    select   the fastest plan within budget on eval data (or the closest, infeasible)
    write    the compact policy (+ Pareto front), MLflow artifacts

This module orchestrates: tuning/prepare.py (prepare, space), run.py (search) and
write.py (select, write) are its stages; the numerics live in the modules they call.
Tracking is a callback of the search and a last step of write.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from autoprec.errors import TuneInterrupted
from autoprec.io.validate import keyword_errors
from autoprec.stream.progress import block_progress
from autoprec.study.storage import count_finished
from autoprec.track import NullTracker, Tracker
from autoprec.tuning.config import TuneConfig
from autoprec.tuning.confirm import choose_plan
from autoprec.tuning.memory import StagePeaks, peak_bytes, release_freed
from autoprec.tuning.prepare import make_space, prepare
from autoprec.tuning.result import TuneResult
from autoprec.tuning.run import Search, run_search
from autoprec.tuning.write import per_layer, write
from autoprec.workload.loading import ModelSpec


def tune(model: str | Path | ModelSpec, config: TuneConfig | None = None, *,
         tracker: Tracker | None = None, profile: Any = None, **options: Any) -> TuneResult:
    """Find the fastest plan within the budget and write it as a policy.

    ``config``: a ``TuneConfig`` (tuning/config.py: every option, validated once; the CLI
    builds one), or its fields as keywords (``tune(model, max_error=0.01, trials=20)``).
    ``trials`` is the number of trials this process runs at most (the search stops sooner
    once nothing faster is predicted within budget, or after ``patience`` trials without a
    faster plan); ``resume=True``: run until the study holds that many finished trials.
    ``tracker``: None logs nothing (the CLI's default is MLflow in ./mlflow.db:
    ``autoprec.track.make_tracker``). ``measure`` (a target that is this machine: ``cpu``,
    or the GPU here): price on a profile calibrated here and time the winner beside fp32
    and one global autocast, never writing a plan measured slower
    (``tuning/confirm.py``). ``report``: a folder to write the tables and plots into
    (trials, Pareto front, per-layer precisions, and the tuned plan beside one global
    autocast per precision), MLflow or not. ``compile=True`` prices every plan as
    ``torch.compile`` runs it (cost/compiled.py) and records ``target.mode: compile`` (the
    measured confirmation times eager forwards, so it is skipped then); ``profile``: a
    DeviceProfile to price with (e.g. calibrated here) instead of ``target``'s.
    ``memory_limit_gb``: the device's memory for the up-front check that the model fits
    twice (``autoprec.tuning.memory``; default: what the device reports). The model as given is
    the reference (``autoprec.workload.reference``): a bf16 model's errors are against its own
    outputs and its policy records ``reference:``.
    See docs/overview.md for the contract.
    """
    started = time.monotonic()
    if config is not None and options:
        raise TypeError(f"tune: give a TuneConfig or its options, not both (got config and "
                        f"{', '.join(sorted(options))})")
    cfg = (config if config is not None else TuneConfig(**options)).validated()
    with keyword_errors(not cfg.from_cli):  # a Python caller reads its keyword arguments
        return _tune(model, cfg, tracker, profile, started)


def _tune(model: str | Path | ModelSpec, cfg: TuneConfig, tracker: Tracker | None,
          profile: Any, started: float) -> TuneResult:
    tracker = tracker or NullTracker()
    peaks = StagePeaks()
    searched: list[Search] = []  # once the study holds trials, Ctrl-C says how to resume
    with _resumable(searched) as check_interrupt:
        prep = prepare(model, cfg, profile, peaks)
        check_interrupt()  # a Ctrl-C Python dropped in the long stages stops before the search
        with peaks.stage("search"), block_progress(prep.net, "search", cfg.output.progress):
            space = make_space(prep, cfg)
            interrupted: list[bool] = []
            searched.append(run_search(prep, space, cfg, tracker, interrupted))
        search = searched[0]
        # select, confirm on the eval data, decide; write
        with peaks.stage("confirm"), block_progress(prep.net, "confirm", cfg.output.progress):
            plan = choose_plan(prep, space, search, cfg)
            check_interrupt()  # a Ctrl-C Python dropped stops here, before anything is written
            result = write(prep, space, search, cfg, tracker, started, plan)
    release_freed()
    if cfg.output.report is not None:
        from autoprec.tuning.report import write_report

        result = replace(result, report=write_report(
            Path(cfg.output.report), result, list(space.region.choices),
            per_layer(prep, space, result.policy)))
    peak, how = peak_bytes(prep.net)
    # the per-stage resets reset ru_maxrss too (Linux): the peak is the highest stage's
    costs = replace(result.costs, peak_memory=max(peak, peaks.overall), peak_memory_how=how,
                    memory_stages=dict(peaks.peaks),
                    stage_seconds={k: round(v, 2) for k, v in peaks.seconds.items()},
                    stage_cpu_seconds={k: round(v, 2) for k, v in peaks.cpu_seconds.items()})
    return replace(result, costs=costs)


@contextlib.contextmanager
def _resumable(searched: list[Search]) -> Iterator[Callable[[], None]]:
    """Ctrl-C once the search is done (``searched`` holds it): a ``TuneInterrupted`` saying
    how to go on from the study's finished trials (``resume=True`` / ``--resume`` runs none
    of them again). The search raises its own when interrupted.

    A KeyboardInterrupt raised while Python runs a garbage-collection callback (SQLAlchemy
    has some) is printed and dropped by Python itself. In the main thread, under Python's
    default Ctrl-C handler, every Ctrl-C is also recorded; the yielded check raises one that
    was dropped (the tune calls it before writing anything)."""
    seen: list[bool] = []

    def check() -> None:
        if seen:
            raise KeyboardInterrupt

    def on_int(signum: int, frame: Any) -> None:
        seen.append(True)
        raise KeyboardInterrupt

    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, on_int) if ours else None
    try:
        yield check
    except TuneInterrupted:
        raise
    except KeyboardInterrupt as err:
        if not searched:
            raise
        search = searched[0]
        raise TuneInterrupted(search.study_name, search.storage_desc,
                              count_finished(search.study)) from err
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)


__all__ = ["TuneConfig", "TuneResult", "tune"]  # tuning/config.py, tuning/result.py
