"""autoprec: automatic per-layer precision tuning for PyTorch.

The public API, for the model you hold (an ``nn.Module`` and iterables of batches, a
``DataLoader`` included) or a model.py (the CLI's way to give the same arguments)::

    tune(model, calibration=…, max_error=…) -> TuneResult   # TuneConfig: every option
    check(model, policy, calibration=…)     -> CheckResult  # the pre-deployment gate
    evaluate(model, policy, calibration=…)  -> Evaluation   # error, audit, speed-up
    load_policy(path) -> Policy;  apply_policy(model, policy) -> PolicyHandle
    trace_model(model, batch) -> LayerGraph;  probe_model(model, batches) -> SensitivityTable

Every bad input raises an ``AutoprecError`` subclass naming the argument, file or layer.
The names are imported lazily, so ``import autoprec`` stays cheap (torch, optuna and
mlflow load when first used). ``autoprec.trace`` and ``autoprec.probe`` are the stages'
packages (importing ``autoprec.trace.graph`` binds the package there), so their functions
are exported as ``trace_model`` and ``probe_model``. The stages' own names stay in their
packages (``autoprec.plan.compile_plan``, ``autoprec.device.capability.capability``, …).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec._version import __version__
from autoprec.io.lazy import lazy_exports

#: public name -> its module under autoprec: "module" (the same name) or "module:name"
_EXPORTS = {
    "tune": "api",
    "TuneConfig": "tuning.config",
    "TuneResult": "tuning.result",
    "Target": "pricing.target",
    "check": "api",
    "CheckResult": "evaluation.check",
    "evaluate": "api",
    "Evaluation": "evaluation.eval_report",
    "Policy": "policy",
    "load_policy": "policy",
    "apply_policy": "apply.apply",
    "ApplyOptions": "apply.apply",
    "PolicyHandle": "apply.apply",
    "trace_model": "trace:trace",
    "LayerGraph": "trace.graph",
    "probe_model": "probe:probe",
    "SensitivityTable": "probe",
    "AutoprecError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.api import check, evaluate, tune
    from autoprec.apply.apply import ApplyOptions, PolicyHandle, apply_policy
    from autoprec.errors import AutoprecError
    from autoprec.evaluation.check import CheckResult
    from autoprec.evaluation.eval_report import Evaluation
    from autoprec.policy import Policy, load_policy
    from autoprec.pricing.target import Target
    from autoprec.probe import SensitivityTable
    from autoprec.probe import probe as probe_model
    from autoprec.trace import trace as trace_model
    from autoprec.trace.graph import LayerGraph
    from autoprec.tuning.config import TuneConfig
    from autoprec.tuning.result import TuneResult


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
