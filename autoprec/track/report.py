"""The files a tuning run leaves in MLflow: policy, tables and plots on the parent run.

Artifact layout on the parent run::

    policy/<policy file name>      the policy YAML, as written by tune
    tables/sensitivity.csv         the probe's SensitivityTable (when there is one)
    tables/trials.csv              one row per trial: number, state, calibration_error,
                                   error (held-out, where confirmed), est_time,
                                   est_speedup, feasible, params_<layer> (precision)
    plots/pareto.png               error vs estimated speed-up: every plan the search priced
                                   (predicted error), those measured, fp32 and the
                                   one-liners, the budget; the chosen plan marked

One vocabulary with the policy file (``metrics``): ``error`` is always the held-out (eval
data) error, where the budget binds; ``calibration_error`` is what the search scored.
    plots/layers.png               the chosen precision of every layer
    tables/baselines.csv,          ``tune --report`` only: the tuned plan beside one global
    plots/baselines.png            autocast per precision (held-out error, est. speed-up)

The parent also gets the tag ``autoprec.policy_artifact`` (the policy's artifact path).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from autoprec.track.base import Tracker, TrackingWarning
from autoprec.track.plots import baselines_plot, layers_plot, pareto_plot

POLICY_DIR = "policy"
TABLES_DIR = "tables"
PLOTS_DIR = "plots"


@dataclass
class PlotPlans:
    """What the Pareto plot shows beside the trials: ``priced`` (predicted errors,
    estimated speed-ups) of the plans the search priced; ``baselines`` (``plan``, ``error``,
    ``est_speedup`` rows: fp32, the one-liners); ``chosen``: the written plan's (error,
    speed-up) when it is no trial (a baseline won)."""

    priced: tuple[Sequence[float], Sequence[float]] | None = None
    baselines: pd.DataFrame | None = None
    chosen: tuple[float, float] | None = None


def _writers(
    *,
    sensitivity: pd.DataFrame | None,
    trials: pd.DataFrame,
    layers: dict[str, str],
    chosen_trial: int | None,
    budget: float | None,
    baselines: pd.DataFrame | None = None,
    plans: PlotPlans | None = None,
) -> list[tuple[str, str, Callable[[Path], object]]]:
    """(file name, artifact folder, writer) for every report file."""
    plans = plans or PlotPlans()
    beside = plans.baselines if plans.baselines is not None else baselines

    def table(frame: pd.DataFrame) -> Callable[[Path], object]:
        # A meaningful index (e.g. layer x precision) is kept; a plain RangeIndex is not.
        keep_index = not isinstance(frame.index, pd.RangeIndex)
        return lambda path: frame.to_csv(path, index=keep_index)

    writers: list[tuple[str, str, Callable[[Path], object]]] = []
    if sensitivity is not None:
        writers.append(("sensitivity.csv", TABLES_DIR, table(sensitivity)))
    writers += [
        ("trials.csv", TABLES_DIR, table(trials)),
        (
            "pareto.png",
            PLOTS_DIR,
            lambda path: pareto_plot(trials, path, chosen_trial=chosen_trial, budget=budget,
                                     priced=plans.priced, baselines=beside,
                                     chosen=plans.chosen),
        ),
        ("layers.png", PLOTS_DIR, lambda path: layers_plot(layers, path)),
    ]
    if baselines is not None:
        writers += [
            ("baselines.csv", TABLES_DIR, table(baselines)),
            ("baselines.png", PLOTS_DIR,
             lambda path: baselines_plot(baselines, path, budget=budget)),
        ]
    return writers


def write_tune_report(
    workdir: Path,
    *,
    sensitivity: pd.DataFrame | None,
    trials: pd.DataFrame,
    layers: dict[str, str],
    chosen_trial: int | None,
    budget: float | None = None,
    baselines: pd.DataFrame | None = None,
    plans: PlotPlans | None = None,
) -> dict[str, Path]:
    """Write sensitivity.csv (if given), trials.csv, pareto.png and layers.png (and
    baselines.csv / baselines.png when given) into ``workdir``; return file name -> path.
    Raises on the first failure."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, _, write in _writers(
        sensitivity=sensitivity,
        trials=trials,
        layers=layers,
        chosen_trial=chosen_trial,
        budget=budget,
        baselines=baselines,
        plans=plans,
    ):
        write(workdir / name)
        written[name] = workdir / name
    return written


def log_tune_artifacts(
    tracker: Tracker,
    *,
    policy_path: Path,
    sensitivity: pd.DataFrame | None,
    trials: pd.DataFrame,
    layers: dict[str, str],
    chosen_trial: int | None,
    workdir: Path,
    budget: float | None = None,
    plans: PlotPlans | None = None,
) -> None:
    """Log the policy file and the report (written into ``workdir``) on the parent run.

    Does nothing for a disabled tracker (``--no-track``; use ``write_tune_report`` for the
    files alone). Never raises for a report file: one that cannot be written is skipped
    with a TrackingWarning, the others are still logged; the tuning result is safe.
    """
    if not tracker.enabled:
        return
    policy_path = Path(policy_path)
    tracker.log_artifact(policy_path, POLICY_DIR)
    tracker.set_tags({"autoprec.policy_artifact": f"{POLICY_DIR}/{policy_path.name}"})
    workdir = Path(workdir)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(
            f"autoprec: cannot create {workdir} for the tuning report ({err}); not logged",
            TrackingWarning,
            stacklevel=2,
        )
        return
    for name, folder, write in _writers(
        sensitivity=sensitivity,
        trials=trials,
        layers=layers,
        chosen_trial=chosen_trial,
        budget=budget,
        plans=plans,
    ):
        path = workdir / name
        try:
            write(path)
        except Exception as err:
            warnings.warn(
                f"autoprec: could not write {path} ({type(err).__name__}: {err}); not logged",
                TrackingWarning,
                stacklevel=2,
            )
            continue
        tracker.log_artifact(path, folder)
