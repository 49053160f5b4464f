"""The options of a tune, by concern: one object from the command line to the policy writer.

``TuneConfig`` is what a user states (``autoprec tune``'s options, ``autoprec.tune``'s
keywords), in six small typed objects a stage reads one of: ``Budget`` (max_error /
max_drop), ``Pricing`` (target, batch, form, compile, measure, memory), ``SearchOptions``
(precisions, trials, stopping, seed, locked paths), ``StudyOptions`` (storage, name,
resume), ``TrainCheck`` (--train-aware's short run) and ``Output`` (policy file, caches,
report, progress). Each flag maps onto one field of one of them (``OPTION_OF``).
``TuneConfig.validated`` checks every value that needs neither the model nor the data,
each concern by its own ``validated``, once, before any work (no probe runs, no study
database is made, no worker or tracking run starts for a value that was wrong from the
start), and returns the normalised config the stages read. The CLI builds and validates
it once (``cli/tune_cmd.py``) and hands it to ``tune``, which validates only a config
that was not (the Python API). The single-value rules are ``autoprec.io.validate``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autoprec.cost import get_profile
from autoprec.device.targets import DEFAULT_TARGET, canonical_target
from autoprec.errors import InputError
from autoprec.formats.precisions import FORMS, PRECISIONS, check_precision, parse_precisions
from autoprec.io.fileio import brief
from autoprec.io.paths import check_dir, check_out_path
from autoprec.io.validate import (
    DEFAULT_MAX_ERROR,
    check_batch_size,
    check_budget,
    check_count,
    check_out_not_input,
    check_seconds,
    check_seed,
    is_number,
    keyword_errors,
)
from autoprec.study.storage import check_storage_url
from autoprec.training.short_run import DEFAULT_LR, DEFAULT_MAX_LOSS_GAP, DEFAULT_STEPS

#: ``--fuse-groups`` values.
FUSE_GROUPS = ("auto", "off")


@dataclass(frozen=True)
class Budget:
    """How far a plan may move the outputs: ``max_error`` (relative L2 against the model as
    given; default ``DEFAULT_MAX_ERROR``) or ``max_drop`` (of model.py's metric), not both."""

    max_error: float | None = None
    max_drop: float | None = None

    def validated(self) -> Budget:
        check_budget(self.max_error, self.max_drop)
        return self

    @property
    def value(self) -> float:
        """The budget's value (``--max-drop``'s, else ``--max-error``'s or its default)."""
        if self.max_drop is not None:
            return float(self.max_drop)
        return float(DEFAULT_MAX_ERROR if self.max_error is None else self.max_error)

    @property
    def name(self) -> str:
        """"max_error" or "max_drop"."""
        return "max_drop" if self.max_drop is not None else "max_error"

    @property
    def use_metric(self) -> bool:
        return self.name == "max_drop"


@dataclass(frozen=True)
class Pricing:
    """What a plan is priced on and how it runs there: the target (a profile, or this
    machine measured: ``measure``), the batch, eager or ``compile``, the ``form`` (None:
    "train" with ``--train-aware``, else "deploy"), fused groups, the memory limits."""

    target: str = DEFAULT_TARGET
    batch_size: int | None = None
    # a local target: calibrate here, time the winner (a profile fitted on another CPU
    # promised 1.82x for a policy that ran 0.56x of fp32's speed here)
    measure: bool = True
    compile: bool = False  # price plans as torch.compile (inductor) runs them
    #: the form plans run in (precisions.FORMS): "deploy" (weights stored in their
    #: precision) unless --train-aware, whose training runs the "train" form
    form: str | None = None
    #: "auto": a fused runtime's groups (q/k/v, gate/up, an MoE layer's experts;
    #: ``trace.fused_groups``) take one precision; "off": every layer its own
    fuse_groups: str = "off"
    #: a plan holding more weight bytes on the device cannot deploy (None: no limit)
    max_weight_mb: float | None = None
    #: the device's memory for the up-front check that the model fits twice
    #: (autoprec.tuning.memory.check_fits; None: what the device reports)
    memory_limit_gb: float | None = None

    def validated(self, train_aware: bool) -> Pricing:
        if not isinstance(self.target, str):
            raise InputError(f"--target: must be a device name, got {brief(self.target)}")
        get_profile(self.target)  # an unknown device: InputError naming the known ones
        check_batch_size(self.batch_size)
        form = self.form if self.form is not None else ("train" if train_aware else "deploy")
        if form not in FORMS:
            raise InputError(f"--form must be one of {', '.join(FORMS)}, got {form!r}")
        _check_positive(self.max_weight_mb, "--max-weight-mb", "megabytes")
        _check_positive(self.memory_limit_gb, "--memory-limit", "gigabytes")
        if self.fuse_groups not in FUSE_GROUPS:
            raise InputError(f"--fuse-groups must be one of {', '.join(FUSE_GROUPS)}, got "
                             f"{brief(self.fuse_groups)}")
        return replace(self, target=canonical_target(self.target), form=form,
                       compile=bool(self.compile),
                       max_weight_mb=None if self.max_weight_mb is None
                       else float(self.max_weight_mb))

    @property
    def memory_limit(self) -> int | None:
        """``memory_limit_gb`` in bytes (None: what the device reports)."""
        return None if self.memory_limit_gb is None else int(self.memory_limit_gb * 1e9)

    @property
    def mode(self) -> str:
        """The deployment mode plans are priced for: "compile" or "eager"."""
        from autoprec.pricing.target import mode_of

        return mode_of(self.compile)


@dataclass(frozen=True)
class SearchOptions:
    """The search: the precisions offered (a sequence or the CLI's comma list; None: every
    one the target runs; fp32 always), how many trials this process runs, when it stops
    (``timeout``, ``patience``), the sampler's ``seed``, a Pareto front, the paths it may
    not change (``locked``) and the speed-up a written plan must reach."""

    precisions: Sequence[str] | str | None = None
    trials: int = 40
    timeout: float | None = None
    seed: int = 0
    patience: int | None = None
    pareto: bool = False
    locked: Sequence[str] = ()
    min_speedup: float | None = None

    def validated(self, target: str, workers: int) -> SearchOptions:
        check_count(workers, "--workers")
        check_count(self.trials, "--trials")
        check_count(self.patience, "--patience", optional=True)
        check_seed(self.seed, workers=workers)
        check_seconds(self.timeout, "--timeout")
        ms = self.min_speedup
        if ms is not None and not (is_number(ms) and math.isfinite(ms) and ms > 0):
            raise InputError(f"--min-speedup: must be a finite number > 0, got {brief(ms)}")
        return replace(self, precisions=_precisions(self.precisions, target,
                                                    get_profile(target)),
                       locked=tuple(self.locked))


@dataclass(frozen=True)
class StudyOptions:
    """Where the trials are kept: the Optuna storage URL (None: SQLite beside the policy),
    the study's name (None: from the model, target and budget) and ``resume`` (run until
    the study holds ``trials`` finished trials)."""

    storage: str | None = None
    study_name: str | None = None
    resume: bool = False

    def validated(self) -> StudyOptions:
        name = self.study_name
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise InputError("--study-name: must not be empty")
        if self.storage is not None:
            check_storage_url(self.storage)
        return self


@dataclass(frozen=True)
class TrainCheck:
    """``--train-aware``: the written plan and each one-liner trained for a short run
    (``autoprec.training.short_run``: steps from one init on the calibration batches,
    AdamW's rate), kept only within ``max_loss_gap`` of fp32's eval loss."""

    train_aware: bool = False
    train_steps: int = DEFAULT_STEPS
    train_lr: float = DEFAULT_LR
    max_loss_gap: float = DEFAULT_MAX_LOSS_GAP

    def validated(self, form: str) -> TrainCheck:
        check_count(self.train_steps, "--train-steps")
        lr = self.train_lr
        if not (is_number(lr) and math.isfinite(lr) and lr > 0):
            raise InputError(f"--train-lr: must be a finite number > 0, got {brief(lr)}")
        mlg = self.max_loss_gap
        if not (is_number(mlg) and math.isfinite(mlg) and mlg >= 0):
            raise InputError(f"--max-loss-gap: must be a finite number >= 0 (relative: 0.01 "
                             f"is 1 %), got {brief(mlg)}")
        if self.train_aware and form != "train":
            raise InputError("--train-aware checks that the plan trains like fp32, which runs "
                             "the train form (autocast over fp32 masters): drop --form deploy")
        return self


@dataclass(frozen=True)
class Output:
    """What the tune writes and shows: the policy file (None: ``policies/<model>-<target>.yaml``),
    the probe cache's folder (None: beside the policy), a ``report`` folder of tables and
    plots, and the progress bars."""

    out: str | Path | None = None
    cache_dir: str | Path | None = None
    report: str | Path | None = None
    progress: bool = True

    def validated(self, model: Any, storage: str | None, mlflow_uri: Any) -> Output:
        out = Path(self.out) if self.out is not None else None
        if out is not None:
            check_out_path(out)
            check_out_not_input(out, model=model, storage=storage, mlflow_uri=mlflow_uri)
        else:  # tune's default: policies/<model>-<target>.yaml
            check_dir(Path("policies"), "the policy folder")
        if self.cache_dir is not None:
            check_dir(Path(self.cache_dir), "--cache-dir")
        if self.report is not None:  # before any work: the folder, and matplotlib
            from autoprec.io.extras import require

            check_dir(Path(self.report), "--report")
            require("matplotlib", "tune --report's plots")
        return replace(self, out=out,
                       cache_dir=Path(self.cache_dir) if self.cache_dir is not None else None,
                       report=Path(self.report) if self.report is not None else None)


#: TuneConfig's concerns: attribute -> class.
CONCERNS: dict[str, type] = {"budget": Budget, "pricing": Pricing, "search": SearchOptions,
                             "study": StudyOptions, "train_check": TrainCheck,
                             "output": Output}
#: Every option (``autoprec tune``'s flag, ``autoprec.tune``'s keyword) -> its concern.
OPTION_OF: dict[str, str] = {f.name: c for c, cls in CONCERNS.items() for f in fields(cls)}
#: The options of ``autoprec.tune`` (``tune(model, **options)``).
OPTIONS = tuple(OPTION_OF)


@dataclass(frozen=True, init=False)
class TuneConfig:
    """Every option of a tune (docs/overview.md's ``autoprec tune``), by concern: the
    ``budget``, the ``pricing`` (target and form), the ``search``, the ``study``, the
    ``train_check`` and the ``output``. Built from the options as a user gives them
    (``TuneConfig(max_error=0.01, trials=20)``: each goes to its concern, ``OPTION_OF``)
    or from the concerns themselves (``TuneConfig(search=SearchOptions(trials=20))``).
    After ``validated()``: the target in its one spelling, the precisions in canonical
    order (fp32 always), the form decided, paths as ``Path``.
    """

    budget: Budget
    pricing: Pricing
    search: SearchOptions
    study: StudyOptions
    train_check: TrainCheck
    output: Output
    _valid: bool = field(default=False, repr=False, compare=False)
    #: validated by the command line: messages name its flags (else the keyword arguments)
    _cli: bool = field(default=False, repr=False, compare=False)

    def __init__(self, **options: Any) -> None:
        given = {c: options.pop(c) for c in CONCERNS if c in options}
        unknown = [k for k in options if k not in OPTION_OF]
        if unknown:
            raise TypeError(f"TuneConfig: unknown option {unknown[0]!r}")
        for name, cls in CONCERNS.items():
            mine = {k: v for k, v in options.items() if OPTION_OF[k] == name}
            if name in given:
                if mine:
                    raise TypeError(f"TuneConfig: give {name}= or its options "
                                    f"({', '.join(mine)}), not both")
                value = given[name]
                if not isinstance(value, cls):
                    raise TypeError(f"TuneConfig: {name} must be a {cls.__name__}, got "
                                    f"{type(value).__name__}")
            else:
                value = cls(**mine)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_valid", False)
        object.__setattr__(self, "_cli", False)

    def option(self, name: str) -> Any:
        """One option by its flat name (``cfg.option("trials")`` is ``cfg.search.trials``)."""
        return getattr(getattr(self, OPTION_OF[name]), name)

    def validated(self, *, workers: int = 1, model: Any = None,
                  mlflow_uri: Any = None, cli: bool = False) -> TuneConfig:
        """This config checked and normalised (itself when it already is), each concern by
        its own ``validated``.

        ``workers``: processes sharing the study (their seeds are seed..seed+N-1);
        ``model`` and ``mlflow_uri``: files the policy may not overwrite. Raises
        ``InputError`` naming the option and the rule for the first bad value: its CLI
        flag with ``cli`` (``--max-error``), else its keyword (``max_error``).
        """
        if self._valid:
            return self
        with keyword_errors(not cli):
            budget = self.budget.validated()
            study = self.study.validated()
            pricing = self.pricing.validated(self.train_check.train_aware)
            search = self.search.validated(pricing.target, workers)
            train_check = self.train_check.validated(str(pricing.form))
            output = self.output.validated(model, study.storage, mlflow_uri)
        done = TuneConfig(budget=budget, pricing=pricing, search=search, study=study,
                          train_check=train_check, output=output)
        object.__setattr__(done, "_valid", True)
        object.__setattr__(done, "_cli", cli)
        return done

    @property
    def from_cli(self) -> bool:
        """Validated by the command line (messages name its flags)."""
        return self._cli

    def with_seed(self, seed: int) -> TuneConfig:
        """The same config with another sampler seed (a ``--workers`` process's own)."""
        done = TuneConfig(budget=self.budget, pricing=self.pricing,
                          search=replace(self.search, seed=seed), study=self.study,
                          train_check=self.train_check, output=self.output)
        object.__setattr__(done, "_valid", self._valid)
        object.__setattr__(done, "_cli", self._cli)
        return done

    @property
    def is_validated(self) -> bool:
        return self._valid


def _precisions(given: Sequence[str] | str | None, target: str, profile: Any
                ) -> tuple[str, ...]:
    """The precisions to search, canonical order, fp32 always. DESIGN: --precisions
    defaults to every precision the target supports (probing a format the target lacks
    would cost probe passes for choices that cannot win)."""
    if isinstance(given, str):
        given = parse_precisions(given)
    names = given or profile.precisions
    wanted = {check_precision(p, "--precisions") for p in names}
    out = tuple(p for p in PRECISIONS if p in wanted or p == "fp32")
    if given:  # before any work: a list the target runs none of tunes nothing
        lower = [p for p in out if p != "fp32"]
        if not lower:
            raise InputError("--precisions: give at least one precision below fp32 "
                             f"(the target {target} runs {', '.join(profile.precisions)})")
        if not any(profile.supports(p)[0] for p in lower):
            why = "; ".join(profile.supports(p)[1] for p in lower)
            raise InputError(f"--precisions {','.join(lower)}: the target {target} runs "
                             f"none of them ({why[:300]}); it runs "
                             f"{', '.join(profile.precisions)}")
    return out


def _check_positive(value: Any, flag: str, unit: str) -> None:
    if value is not None and not (is_number(value) and math.isfinite(value) and value > 0):
        raise InputError(f"{flag} must be a positive number of {unit}, got {value!r}")


__all__ = ["CONCERNS", "DEFAULT_MAX_ERROR", "FUSE_GROUPS", "OPTIONS", "OPTION_OF", "Budget",
           "Output", "Pricing", "SearchOptions", "StudyOptions", "TrainCheck", "TuneConfig"]
