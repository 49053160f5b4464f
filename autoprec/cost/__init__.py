"""Cost stage: estimated (roofline + casts) or measured time of a model on a device.

``CostModel(graph, get_profile("h100"), batch_size=256).estimate({"fc1": "fp8"})``
prices an assignment (``CompiledCostModel``: as ``torch.compile`` runs it); ``measure_latency`` times a callable; ``calibrate.fit`` turns
measurements into a profile's efficiency factors.
"""

from autoprec.cost.calibrate import FitResult, Sample, fit
from autoprec.cost.compiled import MODES, CompiledCostModel, make_cost_model
from autoprec.cost.measure import Timing, measure_interleaved, measure_latency
from autoprec.cost.model import Breakdown, CostModel, Kernel
from autoprec.cost.profiles import (
    Calibration,
    DeviceProfile,
    apply_calibration,
    get_profile,
    known_devices,
    load_calibration,
    load_profiles,
)

__all__ = [
    "Breakdown",
    "Calibration",
    "CompiledCostModel",
    "CostModel",
    "DeviceProfile",
    "FitResult",
    "Kernel",
    "MODES",
    "Sample",
    "Timing",
    "apply_calibration",
    "fit",
    "get_profile",
    "known_devices",
    "load_calibration",
    "load_profiles",
    "make_cost_model",
    "measure_interleaved",
    "measure_latency",
]
