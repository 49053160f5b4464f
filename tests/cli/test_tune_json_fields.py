"""``autoprec tune --json``: its keys and values, read from the TuneResult's concerns.

The result is held by concern (``autoprec.tuning.result``); the JSON object keeps the keys
it had when the result was one flat dataclass, in the same order, with the same values."""

from __future__ import annotations

import json
import math
from pathlib import Path

from autoprec.cli.tune_cmd import _not_feasible, _summary
from autoprec.policy import Policy
from autoprec.tuning.result import RunCosts, SearchRecord, TrainCheckRuns, TuneResult, WrittenPlan
from autoprec.workload.reference import ModelReference

#: ``tune --json``'s keys, in order (``batch_size_from`` is added by the command).
TUNE_JSON_KEYS = [
    "policy", "feasible", "error", "calibration_error", "budget", "est_speedup", "target",
    "mode", "batch_size", "trials", "evaluations", "seconds", "study", "storage", "front",
    "mlflow_run", "search_complete", "candidates", "plans_priced", "plans_measured",
    "est_casts", "notes", "form", "weight_bytes", "measured_speedup", "baselines", "report",
    "reference", "est_speedup_over_reference", "model_weight_bytes", "peak_memory_bytes",
    "peak_memory_measured", "memory_stages", "peak_memory_stage", "stage_seconds",
    "stage_cpu_seconds", "train_check_seconds", "train_checks"]


def _result(eval_error: float = 0.0101, reference: ModelReference | None = None
            ) -> TuneResult:
    ref = reference or ModelReference()
    policy = Policy(default="bf16", layers={"a.b": "fp32"}, form="deploy",
                    target={"device": "h100", "batch_size": 64, "mode": "compile"},
                    metrics={"est_casts": 3, "weight_bytes": 1234, "measured_speedup": 1.5},
                    provenance={"mlflow_run": "abc"})
    return TuneResult(
        plan=WrittenPlan(policy=policy, path=Path("/x/p.yaml"), feasible=False,
                         error=0.00912345, eval_error=eval_error, est_speedup=1.234567,
                         budget=0.01, front=[policy], front_paths=[Path("/x/p.front0.yaml")],
                         notes=["n1", "n2"], reference=ref, weight_bytes=4321),
        search=SearchRecord(study_name="st", storage="sqlite:///s.db", trials=7,
                            evaluations=3.14159, priced=99, measured=5, complete=True,
                            method="enumeration", trials_table=[{"number": 0}]),
        costs=RunCosts(seconds=12.345, peak_memory=10**9, peak_memory_how="peak RSS",
                       memory_stages={"probe": 5, "search": 9},
                       stage_seconds={"probe": 1.5, "search": 2.25},
                       stage_cpu_seconds={"probe": 3.0}),
        train_check=TrainCheckRuns(verdicts=[{"rule": "x"}], table=["t1"], seconds=4.567,
                                   cpu_seconds=3.21),
        report=[Path("/r/a.csv")])


def test_the_json_has_the_same_keys_and_values() -> None:
    got = _summary(_result(), "h100", True)
    assert list(got) == TUNE_JSON_KEYS
    assert got == {
        "policy": "/x/p.yaml", "feasible": False, "error": 0.0101,
        "calibration_error": 0.00912345, "budget": 0.01, "est_speedup": 1.2346,
        "target": "h100", "mode": "compile", "batch_size": 64, "trials": 7,
        "evaluations": 3.14, "seconds": 12.3, "study": "st", "storage": "sqlite:///s.db",
        "front": ["/x/p.front0.yaml"], "mlflow_run": "abc", "search_complete": True,
        "candidates": "enumeration", "plans_priced": 99, "plans_measured": 5, "est_casts": 3,
        "notes": ["n1", "n2"], "form": "deploy", "weight_bytes": 1234,
        "measured_speedup": 1.5, "baselines": None, "report": ["/r/a.csv"],
        "reference": {"dtype": "fp32"}, "est_speedup_over_reference": 1.2346,
        "model_weight_bytes": 4321, "peak_memory_bytes": 10**9,
        "peak_memory_measured": "peak RSS", "memory_stages": {"probe": 5, "search": 9},
        "peak_memory_stage": "search", "stage_seconds": {"probe": 1.5, "search": 2.25},
        "stage_cpu_seconds": {"probe": 3.0}, "train_check_seconds": 4.57,
        "train_checks": [{"rule": "x"}]}
    json.dumps(got)  # printable as it is


def test_an_infinite_error_and_a_16_bit_reference() -> None:
    got = _summary(_result(math.inf, ModelReference("bf16", {"lm_head": "fp32"}, 99)),
                   "h100", False)
    assert list(got) == TUNE_JSON_KEYS
    assert got["error"] == "inf" and got["reference"] == {"dtype": "bf16",
                                                          "layers": {"lm_head": "fp32"}}
    assert str(_not_feasible(_result(math.inf), None, "inf")) == (
        "no feasible policy within budget 0.01; wrote the closest (error inf) to /x/p.yaml "
        "marked feasible: false")
