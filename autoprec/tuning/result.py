"""What a tune produced, by concern (as ``TuneConfig`` holds its options by concern).

``TuneResult`` composes:

    plan         WrittenPlan     the policy written, its error and speed, its front, notes
    search       SearchRecord    the study and what the search priced, measured and found
    costs        RunCosts        what the tune itself took: wall time, memory, per stage
    train_check  TrainCheckRuns  --train-aware: the short training runs and their time
    report       list[Path]      the files ``tune(report=DIR)`` wrote

The few attributes a user reads first (README's Python API) stay on ``TuneResult``
itself: ``policy``, ``path``, ``feasible``, ``error`` and ``est_speedup`` (the plan's).
``FLAT_NAMES`` says where every attribute of the former flat ``TuneResult`` lives now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.workload.reference import ModelReference

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluation.speed_check import SpeedCheck
    from autoprec.policy import Policy
    from autoprec.trace.graph import LayerGraph


@dataclass(frozen=True)
class WrittenPlan:
    """The plan written: the ``policy`` (at ``path``), whether it is within the ``budget``
    (``feasible``), its error on the calibration data (``error``) and on the eval data
    (``eval_error``, both in budget units), its estimated speed-up over fp32, the
    Pareto ``front`` (``--pareto``: one policy file each), the ``notes`` the user is told,
    the model as given (``reference``, its ``weight_bytes``) and the plan beside its
    baselines (``speed``: measured where the target is this machine)."""

    policy: Policy
    path: Path | None
    feasible: bool
    error: float  # on the calibration data (budget units)
    eval_error: float  # on the eval data (budget units)
    est_speedup: float
    budget: float
    front: list[Policy] = field(default_factory=list)
    front_paths: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # things the user should be told
    reference: ModelReference = field(default_factory=ModelReference)  # the model as given
    weight_bytes: int = 0  # the model's own weights (as given)
    speed: SpeedCheck | None = None  # the plan beside its baselines; measured where local


@dataclass(frozen=True)
class SearchRecord:
    """How the plan was found: the study (``study_name`` in ``storage``), the trials and
    model evaluations this process ran, the plans the planner priced and those measured
    on the model, whether the search was ``complete`` and its ``method``; the trials as
    rows, pareto.png's alternatives (``plot_plans``), the probes (``sensitivity``) and the
    model's ``graph``."""

    study_name: str
    storage: str
    trials: int  # trials this process ran
    evaluations: float  # model evaluations this process ran (full-set equivalents)
    priced: int = 0  # plans the planner priced (the candidates it considered)
    measured: int = 0  # distinct plans measured on the model (this study, all runs)
    complete: bool = False  # the planner had nothing faster left to measure
    method: str = ""  # how the candidates were found (enumeration / descent)
    trials_table: list[dict[str, Any]] = field(default_factory=list)
    plot_plans: Any = None  # track.PlotPlans: what pareto.png shows beside the trials
    sensitivity: Any = None  # pandas DataFrame of the probes
    graph: LayerGraph | None = None


@dataclass(frozen=True)
class RunCosts:
    """What the tune itself took: its wall time up to the written plan (``seconds``), its
    memory peak (``autoprec.tuning.memory.peak_bytes``: what was measured in
    ``peak_memory_how``) and each stage's own peak, wall time and CPU time."""

    seconds: float = 0.0
    peak_memory: int = 0  # bytes at the peak of the tune (autoprec.tuning.memory.peak_bytes)
    peak_memory_how: str = ""  # what was measured (peak RSS on CPU, allocated on CUDA)
    memory_stages: dict[str, int] = field(default_factory=dict)  # stage -> its own peak bytes
    stage_seconds: dict[str, float] = field(default_factory=dict)  # stage -> its wall time
    #: stage -> the CPU time this process spent in it (every thread; under a shared load
    #: the wall time grows, this does not)
    stage_cpu_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainCheckRuns:
    """``--train-aware``: every short training run (``verdicts``:
    ``train_check.ShortRunVerdict.to_dict``), the same as table lines, and the confirm
    stage's time spent in them (wall ``seconds`` and ``cpu_seconds``). Empty without it."""

    verdicts: list[dict[str, Any]] = field(default_factory=list)
    table: list[str] = field(default_factory=list)
    seconds: float = 0.0  # of the confirm stage, spent in the short runs
    cpu_seconds: float = 0.0  # ... their CPU time


#: TuneResult's concerns: attribute -> class (``report`` is a list of files).
CONCERNS: dict[str, type] = {"plan": WrittenPlan, "search": SearchRecord, "costs": RunCosts,
                             "train_check": TrainCheckRuns}
#: Every attribute of the flat TuneResult before the split -> where it is now.
FLAT_NAMES: dict[str, str] = {
    **{f: f"plan.{f}" for f in ("eval_error", "budget", "front", "front_paths", "notes",
                                "reference", "weight_bytes", "speed")},
    **{f: f"search.{f}" for f in ("study_name", "storage", "trials", "evaluations", "priced",
                                  "measured", "complete", "method", "trials_table",
                                  "plot_plans", "sensitivity", "graph")},
    **{f: f"costs.{f}" for f in ("seconds", "peak_memory", "peak_memory_how",
                                 "memory_stages", "stage_seconds", "stage_cpu_seconds")},
    "train_checks": "train_check.verdicts", "train_table": "train_check.table",
    "train_seconds": "train_check.seconds", "train_cpu_seconds": "train_check.cpu_seconds",
}


@dataclass(frozen=True)
class TuneResult:
    """What a tune produced, by concern: the ``plan`` written (``WrittenPlan``), how the
    ``search`` found it (``SearchRecord``), what the tune itself cost (``costs``:
    ``RunCosts``), the ``--train-aware`` short runs (``train_check``: ``TrainCheckRuns``)
    and the ``report`` files ``tune(report=DIR)`` wrote.

    ``policy``, ``path``, ``feasible``, ``error`` (calibration data) and ``est_speedup``
    read the plan's own (``result.plan.eval_error`` is the held-out error; ``FLAT_NAMES``
    says where each other former attribute lives: ``result.search.trials``, …).
    """

    plan: WrittenPlan
    search: SearchRecord
    costs: RunCosts = field(default_factory=RunCosts)
    train_check: TrainCheckRuns = field(default_factory=TrainCheckRuns)
    report: list[Path] = field(default_factory=list)  # files tune(report=DIR) wrote

    @property
    def policy(self) -> Policy:
        """The policy written (``plan.policy``)."""
        return self.plan.policy

    @property
    def path(self) -> Path | None:
        """Where the policy was written (``plan.path``)."""
        return self.plan.path

    @property
    def feasible(self) -> bool:
        """Within the budget (``plan.feasible``)."""
        return self.plan.feasible

    @property
    def error(self) -> float:
        """The plan's error on the calibration data, in budget units (``plan.error``)."""
        return self.plan.error

    @property
    def est_speedup(self) -> float:
        """The plan's estimated speed-up over fp32 on the target (``plan.est_speedup``)."""
        return self.plan.est_speedup

    def __getattr__(self, name: str) -> Any:
        """A former flat attribute: an AttributeError saying where it lives now."""
        where = FLAT_NAMES.get(name)
        if where is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(f"TuneResult.{name} is TuneResult.{where} (the result is held "
                             "by concern: plan, search, costs, train_check, report)")


__all__ = ["CONCERNS", "FLAT_NAMES", "RunCosts", "SearchRecord", "TrainCheckRuns",
           "TuneResult", "WrittenPlan"]
