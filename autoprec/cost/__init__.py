"""Cost stage: estimated (roofline + casts) or measured time of a model on a device.

``make_cost_model(graph, get_profile("h100"), 256).estimate({"fc1": "fp8"})`` prices an
assignment: a ``CostModel`` composed of a forward pricer (``EagerPricer``;
``CompiledPricer`` with ``mode="compile"``: as ``torch.compile`` runs it) and, with
``step=True``, a ``StepPart`` (the training step's backward, optimizer and scaler);
``calibrate.fit`` turns measurements (``autoprec.measure``) into a profile's efficiency
factors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec.io.lazy import lazy_exports

#: public name -> the submodule that holds it. Imported on first use (as the root package
#: does): ``autoprec.cost.profiles`` is then readable without torch, and every command's
#: ``--target`` help lists the profiles (``profiles.profile_names``) without the ~3 s
#: torch import a ``show`` or ``--help`` does not need.
_EXPORTS = {
    "FitResult": "calibrate", "Sample": "calibrate", "fit": "calibrate",
    "MODES": "compiled", "CompiledPricer": "compiled", "make_cost_model": "model",
    "EagerPricer": "op_pricing", "StepPart": "step",
    "Breakdown": "model", "CostModel": "model", "Kernel": "model",
    "Calibration": "profiles", "DeviceProfile": "profiles",
    "apply_calibration": "profiles", "get_profile": "profiles", "known_devices": "profiles",
    "load_calibration": "profiles", "load_profiles": "profiles",
}

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.cost.calibrate import FitResult, Sample, fit
    from autoprec.cost.compiled import MODES, CompiledPricer
    from autoprec.cost.model import Breakdown, CostModel, Kernel, make_cost_model
    from autoprec.cost.op_pricing import EagerPricer
    from autoprec.cost.profiles import (
        Calibration,
        DeviceProfile,
        apply_calibration,
        get_profile,
        known_devices,
        load_calibration,
        load_profiles,
    )
    from autoprec.cost.step import StepPart


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)


__all__ = [
    "Breakdown",
    "Calibration",
    "CompiledPricer",
    "CostModel",
    "DeviceProfile",
    "EagerPricer",
    "FitResult",
    "Kernel",
    "MODES",
    "Sample",
    "StepPart",
    "apply_calibration",
    "fit",
    "get_profile",
    "known_devices",
    "load_calibration",
    "load_profiles",
    "make_cost_model",
]
