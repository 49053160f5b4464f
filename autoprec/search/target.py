"""The target a policy is priced and timed for: resolved once, then carried as one value.

A target used to travel as a string (``"cpu"``, ``"h100"``) beside loose ``mode`` and
``measure`` arguments, and every stage re-derived what it needed: the fallback
``target or policy.target_device or DEFAULT_TARGET`` in ``check`` and in ``eval``, the
compile flag turned into a mode in each, the profile looked up again. ``check`` read the
stored profile where ``eval`` read this machine's calibration: 2.59x against 3.01x for one
policy (issue 30). ``resolve_target`` decides all of it once:

- the **name**: given, else the policy's ``target.device``, else ``DEFAULT_TARGET``, in
  its one spelling (``canonical_target``); an unknown name is exit 2 here, before any work;
- the **mode**: ``torch.compile``'d or eager (given, else the policy's ``target.mode``);
- the **speed source** (``speed_source.SpeedSource``): the profile the cost model prices
  with and where it comes from, measured here for a local target, with the model's own
  ops timed on a local CPU; its ``cost_model`` is the one way a price is made.

The device type (whose autocast op lists a plan follows) is ``targets.device_type`` of
the name: the plan replay, the cost model and apply ask it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoprec.search.speed_source import SpeedSource, calibration_dir, speed_source
from autoprec.targets import DEFAULT_TARGET, canonical_target, device_type


def mode_of(compile: bool | None, default: str = "eager") -> str:
    """The deployment mode of a ``--compile`` flag: "compile", "eager", or ``default``
    when the flag is not given (None)."""
    if compile is None:
        return default
    return "compile" if compile else "eager"


@dataclass
class Target:
    """One target, resolved: its name, deployment mode and speed source."""

    name: str  # canonical profile name: "h100", "cpu", ...
    mode: str  # "eager" | "compile"
    speed: SpeedSource
    named: bool = True  # False: nothing named it (the default was taken)

    @property
    def profile(self) -> Any:
        return self.speed.profile

    @property
    def device_type(self) -> str:
        return device_type(self.name)

    @property
    def local(self) -> bool:
        return self.speed.local

    @property
    def compile(self) -> bool:
        return self.mode == "compile"

    def cost_model(self, graph: Any, batch_size: int | None = None, form: str = "train") -> Any:
        """The cost model of ``graph`` on this target (``SpeedSource.cost_model``)."""
        return self.speed.cost_model(graph, batch_size, self.mode, form=form)


def resolve_target(given: str | None, policy: Any = None, *, compile: bool | None = None,
                   measure: bool = False, cache_dir: Path | None = None,
                   policy_path: Path | None = None) -> Target:
    """The target of a run: ``given`` (``--target``), else ``policy``'s, else the default;
    the mode from ``compile``, else the policy's; the speed source cached in ``cache_dir``
    (default: beside ``policy_path``, as tune caches it beside the policy it writes).
    ``measure``: a local target's calibration may be measured now (else cached only)."""
    named = given or (policy.target_device if policy is not None else None)
    name = canonical_target(named or DEFAULT_TARGET)
    # speed_source looks the profile up once: an unknown device is exit 2 there
    mode = mode_of(compile, policy.mode if policy is not None else "eager")
    cache = cache_dir if cache_dir is not None else calibration_dir(policy_path)
    return Target(name, mode, speed_source(name, measure=measure, cache_dir=cache, mode=mode),
                  named=named is not None)


__all__ = ["Target", "mode_of", "resolve_target"]
