"""The options of a tune, validated in one place before any work (``TuneConfig.make``).

``check_tune_args`` holds every check that needs neither the model nor the data (the CLI
calls it before it starts workers or tracking); the single-value rules are
``autoprec.validate``'s. ``TuneConfig`` holds the normalised values the stages read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoprec.cost import get_profile
from autoprec.errors import InputError
from autoprec.fileio import brief
from autoprec.paths import check_dir, check_out_path
from autoprec.precisions import FORMS, PRECISIONS, check_precision
from autoprec.search.storage import check_storage_url
from autoprec.targets import DEFAULT_TARGET, canonical_target
from autoprec.validate import (
    check_batch_size,
    check_budget,
    check_count,
    check_out_not_input,
    check_seconds,
    check_seed,
    is_number,
)

DEFAULT_MAX_ERROR = 0.01


def check_tune_args(
    *,
    max_error: Any = None,
    max_drop: Any = None,
    target: Any = DEFAULT_TARGET,
    batch_size: Any = None,
    trials: Any = 40,
    timeout: Any = None,
    seed: Any = 0,
    patience: Any = None,
    min_speedup: Any = None,
    storage: Any = None,
    study_name: Any = None,
    out: Any = None,
    cache_dir: Any = None,
    workers: int = 1,
    model: Any = None,
    mlflow_uri: Any = None,
) -> None:
    """Every check of ``tune``'s arguments that needs neither the model nor the data.

    Called by ``autoprec tune`` before anything else (tracking, workers) and by
    ``autoprec.tune`` first thing, so that no probe runs and no study database is made for
    a value that was wrong from the start.
    """
    check_budget(max_error, max_drop)
    check_count(workers, "--workers")
    check_count(trials, "--trials")
    check_count(patience, "--patience", optional=True)
    check_seed(seed, workers=workers)
    check_seconds(timeout, "--timeout")
    check_batch_size(batch_size)
    if min_speedup is not None and not (is_number(min_speedup) and math.isfinite(min_speedup)
                                        and min_speedup > 0):
        raise InputError(f"--min-speedup: must be a finite number > 0, got {brief(min_speedup)}")
    if study_name is not None and (not isinstance(study_name, str) or not study_name.strip()):
        raise InputError("--study-name: must not be empty")
    if not isinstance(target, str):
        raise InputError(f"--target: must be a device name, got {brief(target)}")
    get_profile(target)  # an unknown device: InputError naming the known ones
    if storage is not None:
        check_storage_url(storage)
    if out is not None:
        check_out_path(Path(out))
        check_out_not_input(Path(out), model=model, storage=storage, mlflow_uri=mlflow_uri)
    else:  # tune's default: policies/<model>-<target>.yaml
        check_dir(Path("policies"), "the policy folder")
    if cache_dir is not None:
        check_dir(Path(cache_dir), "--cache-dir")



@dataclass
class TuneConfig:
    """Every option of a tune, validated (``TuneConfig.make``: autoprec.validate's rules,
    before any work)."""

    budget: float
    budget_name: str  # "max_error" or "max_drop"
    target: str
    batch_size: int | None
    precisions: tuple[str, ...]
    trials: int
    timeout: float | None
    seed: int
    patience: int | None
    min_speedup: float | None
    storage: str | None
    study_name: str | None
    resume: bool
    pareto: bool
    out: Path | None
    locked: tuple[str, ...]
    progress: bool
    cache_dir: Path | None
    train_aware: bool
    # a local target: calibrate here, time the winner (a profile fitted on another CPU
    # promised 1.82x for a policy that ran 0.56x of fp32's speed here)
    measure: bool = True
    compile: bool = False  # price plans as torch.compile (inductor) runs them
    #: the form plans run in (precisions.FORMS): "deploy" (weights stored in their
    #: precision) unless --train-aware, whose training runs the "train" form
    form: str = "deploy"
    #: a plan holding more weight bytes on the device cannot deploy (None: no limit)
    max_weight_mb: float | None = None
    #: the device's memory in bytes for the up-front check that the model fits twice
    #: (autoprec.memory.check_fits; None: what the device reports)
    memory_limit: int | None = None

    @classmethod
    def make(cls, *, max_error: float | None, max_drop: float | None, target: str,
             batch_size: int | None, precisions: Sequence[str] | None, trials: int,
             timeout: float | None, seed: int, patience: int | None,
             min_speedup: float | None, storage: str | None, study_name: str | None,
             resume: bool, pareto: bool, out: str | Path | None, locked: Sequence[str],
             progress: bool, cache_dir: str | Path | None, train_aware: bool,
             measure: bool = True, compile: bool = False,
             form: str | None = None, max_weight_mb: float | None = None,
             memory_limit_gb: float | None = None) -> TuneConfig:
        check_tune_args(max_error=max_error, max_drop=max_drop, target=target,
                        batch_size=batch_size, trials=trials, timeout=timeout, seed=seed,
                        patience=patience, min_speedup=min_speedup, storage=storage,
                        study_name=study_name, out=out, cache_dir=cache_dir)
        target = canonical_target(target)  # "CPU" is cpu: one file name, device and plan
        value, name = (max_drop, "max_drop") if max_drop is not None else (
            DEFAULT_MAX_ERROR if max_error is None else max_error, "max_error")
        # DESIGN: --precisions defaults to every precision the target supports (probing a
        # format the target lacks would cost probe passes for choices that cannot win)
        from autoprec.cost import get_profile

        given = precisions or get_profile(target).precisions
        wanted = tuple(check_precision(p, "--precisions") for p in given)
        wanted = tuple(p for p in PRECISIONS if p in wanted or p == "fp32")
        if precisions:  # before any work: a list the target runs none of tunes nothing
            profile = get_profile(target)
            lower = [p for p in wanted if p != "fp32"]
            if not lower:
                raise InputError("--precisions: give at least one precision below fp32 "
                                 f"(the target {target} runs {', '.join(profile.precisions)})")
            if not any(profile.supports(p)[0] for p in lower):
                why = "; ".join(profile.supports(p)[1] for p in lower)
                raise InputError(f"--precisions {','.join(lower)}: the target {target} runs "
                                 f"none of them ({why[:300]}); it runs "
                                 f"{', '.join(profile.precisions)}")
        if form is None:
            form = "train" if train_aware else "deploy"
        if form not in FORMS:
            raise InputError(f"--form must be one of {', '.join(FORMS)}, got {form!r}")
        if max_weight_mb is not None and (isinstance(max_weight_mb, bool) or not
                                          isinstance(max_weight_mb, (int, float))
                                          or not math.isfinite(max_weight_mb)
                                          or max_weight_mb <= 0):
            raise InputError(f"--max-weight-mb must be a positive number of megabytes, got "
                             f"{max_weight_mb!r}")
        if memory_limit_gb is not None and (isinstance(memory_limit_gb, bool) or not
                                            isinstance(memory_limit_gb, (int, float))
                                            or not math.isfinite(memory_limit_gb)
                                            or memory_limit_gb <= 0):
            raise InputError(f"--memory-limit must be a positive number of gigabytes, got "
                             f"{memory_limit_gb!r}")
        if train_aware and form != "train":
            raise InputError("--train-aware checks that the plan trains like fp32, which runs "
                             "the train form (autocast over fp32 masters): drop --form deploy")
        return cls(float(value), name, target, batch_size, wanted, trials, timeout, seed,
                   patience, min_speedup, storage, study_name, resume, pareto,
                   Path(out) if out is not None else None, tuple(locked), progress,
                   Path(cache_dir) if cache_dir is not None else None, train_aware, measure,
                   bool(compile), form,
                   None if max_weight_mb is None else float(max_weight_mb),
                   None if memory_limit_gb is None else int(memory_limit_gb * 1e9))

    @property
    def mode(self) -> str:
        """The deployment mode plans are priced for: "compile" or "eager"."""
        return "compile" if self.compile else "eager"

    @property
    def use_metric(self) -> bool:
        return self.budget_name == "max_drop"


__all__ = ["DEFAULT_MAX_ERROR", "TuneConfig"]
