"""What a target name means, below every stage: the default, and whose autocast it follows.

A target is a device profile name (``autoprec/cost/devices.yaml``: "h100", "cpu", ...; a
profile calibrated on this machine is "cpu-<key>"), or a bare device type ("cuda", "cpu").
Its *device type* decides which autocast op lists a plan follows (CUDA autocast keeps
layer_norm, softmax, ... in fp32; CPU autocast does not): the plan replay, the cost model
and apply all ask ``device_type`` here, so they cannot disagree.
"""

from __future__ import annotations

#: What tune, eval and check price for when no target is given (DESIGN.md).
DEFAULT_TARGET = "h100"


def canonical_target(name: str) -> str:
    """The one spelling of a target name: profile names are lower case, and a user's
    ``--target CPU`` or ``H100`` means the same device (it used to tune a second time, into
    ``policies/<name>-CPU.yaml`` with ``device: CPU`` and another plan)."""
    return name.strip().lower()


def device_type(target: str) -> str:
    """"cpu" for the cpu profiles (and "cpu"), "cuda" for every GPU profile (and "cuda")."""
    return "cpu" if canonical_target(target).startswith("cpu") else "cuda"


__all__ = ["DEFAULT_TARGET", "canonical_target", "device_type"]
