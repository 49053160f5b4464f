"""What a target or device name means, below every stage: the one place names are parsed.

Two kinds of name travel through autoprec, and only this module takes them apart
(``tests/packaging/test_target_strings.py`` keeps it so):

- a **target**: a device profile name (``autoprec/cost/devices.yaml``: "h100", "cpu", ...;
  a profile calibrated on this machine is "cpu-<key>"), or a bare device type ("cuda",
  "cpu"). Its *device type* decides which autocast op lists a plan follows (CUDA autocast
  keeps layer_norm, softmax, ... in fp32; CPU autocast does not): the plan replay, the
  cost model and apply all ask ``device_type`` here, so they cannot disagree.
- a **device**: where something runs or is timed here, as torch spells it ("cpu", "cuda",
  "cuda:1"): ``device_kind``, ``is_cpu``, ``cuda_index``.

Which target a run is for — the one given, else the policy's — is ``named_target``: the
search's ``resolve_target`` adds the default (``DEFAULT_TARGET``) and apply the device at
hand, but neither re-derives the order.
"""

from __future__ import annotations

from autoprec.errors import InputError

#: What tune, eval and check price for when no target is given (docs/overview.md).
DEFAULT_TARGET = "h100"

#: The device kinds autoprec runs and times on (torch's device types).
DEVICE_KINDS = ("cpu", "cuda")


def canonical_target(name: str) -> str:
    """The one spelling of a target name: profile names are lower case, and a user's
    ``--target CPU`` or ``H100`` means the same device (it used to tune a second time, into
    ``policies/<name>-CPU.yaml`` with ``device: CPU`` and another plan)."""
    return name.strip().lower()


def named_target(given: str | None, recorded: str | None = None) -> str | None:
    """The target a run is for, in its one spelling: ``given`` (an argument, ``--target``),
    else ``recorded`` (the policy's ``target.device``); None when neither names one (the
    caller's own default then: the search's ``DEFAULT_TARGET``, apply's device at hand)."""
    name = given or recorded
    return canonical_target(name) if name else None


def device_type(target: str) -> str:
    """"cpu" for the cpu profiles (and "cpu"), "cuda" for every GPU profile (and "cuda")."""
    return "cpu" if canonical_target(target).startswith("cpu") else "cuda"


def is_cpu_target(target: str) -> bool:
    """Whether ``target`` (a profile name) is a CPU: this machine's, when it is local."""
    return device_type(target) == "cpu"


def device_kind(device: str, where: str = "") -> str:
    """"cpu" or "cuda" for a device string ("cpu", "cuda", "cuda:1"); anything else is an
    InputError (``where``: the caller, named in the message)."""
    kind = str(device).split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise InputError(f"{where + ': ' if where else ''}unknown device {device!r}; "
                         "expected cpu or cuda[:N]")
    return kind


def is_cpu(device: str) -> bool:
    """Whether ``device`` ("cpu", "cuda:1", ...) is the CPU."""
    return str(device).split(":", 1)[0] == "cpu"


def cuda_index(device: str) -> int:
    """The CUDA device number of ``device``: "cuda:2" is 2, a bare "cuda" the first, 0."""
    _, _, index = str(device).partition(":")
    if device_kind(device) != "cuda" or (index and not index.isdigit()):
        raise InputError(f"not a CUDA device: {device!r}; expected cuda[:N]")
    return int(index) if index else 0


__all__ = ["DEFAULT_TARGET", "DEVICE_KINDS", "canonical_target", "cuda_index", "device_kind",
           "device_type", "is_cpu", "is_cpu_target", "named_target"]
