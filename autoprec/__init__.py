"""autoprec: automatic per-layer precision tuning for PyTorch.

The flow, one module per stage::

    trace (autoprec.trace) -> probe (autoprec.probe) -> plan (autoprec.plan)
      -> cost (autoprec.cost) -> search (autoprec.search)
      -> policy / apply (autoprec.policy, autoprec.apply) -> track (autoprec.track)

A policy's resolution (which rule covers each module) is read from its compiled plan:
``compile_plan(policy, model).resolution()``, or ``resolve`` / ``assignment``.

The public API is re-exported here and imported lazily, so ``import autoprec`` stays
cheap (torch, optuna and mlflow load when first used). ``autoprec.trace`` and
``autoprec.probe`` are the stages' packages and ``autoprec.capability`` a module; the
functions they hold are exported as ``trace_model``, ``probe_model`` and ``can_run`` (one
name, one thing, whatever was imported first).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> "module" (the same name there) or "module:name there"
_EXPORTS = {
    "trace_model": "autoprec.trace:trace",
    "LayerGraph": "autoprec.trace.graph",
    "LayerNode": "autoprec.trace.graph",
    "probe_model": "autoprec.probe:probe",
    "SensitivityTable": "autoprec.probe",
    "CostModel": "autoprec.cost",
    "get_profile": "autoprec.cost",
    "tune": "autoprec.tuning.tune",
    "TuneResult": "autoprec.tuning.tune",
    "Policy": "autoprec.policy",
    "load_policy": "autoprec.policy",
    "compile_plan": "autoprec.plan",
    "ExecutionPlan": "autoprec.plan",
    "resolve": "autoprec.plan",
    "assignment": "autoprec.plan",
    "resolve_path": "autoprec.plan",
    "apply_policy": "autoprec.apply.apply",
    "can_run": "autoprec.capability:capability",
    "load_model_file": "autoprec.loading",
    "AutoprecError": "autoprec.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.apply.apply import apply_policy
    from autoprec.capability import capability as can_run
    from autoprec.cost import CostModel, get_profile
    from autoprec.errors import AutoprecError
    from autoprec.loading import load_model_file
    from autoprec.plan import ExecutionPlan, assignment, compile_plan, resolve, resolve_path
    from autoprec.policy import Policy, load_policy
    from autoprec.probe import SensitivityTable
    from autoprec.probe import probe as probe_model
    from autoprec.trace import trace as trace_model
    from autoprec.trace.graph import LayerGraph, LayerNode
    from autoprec.tuning.tune import TuneResult, tune


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
    module, _, attr = where.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value
