"""The policy's ``guard`` key: what a deployed plan checks at run time (``apply.guard``).

Two spellings, one meaning::

    guard: detect                  # the mode alone: the default layers, the default fallbacks
    guard:
      mode: fallback               # off | detect | fallback | raise
      layers: [tail1, tail2]       # optional: GEMM layers to check, or "all"
      fallback: {tail1: bf16}      # optional: the precision a layer re-runs in

- ``mode``: ``off`` (no checks; what a policy without ``guard`` means), ``detect`` (count
  and warn once per layer), ``fallback`` (re-run the forward that overflowed with the
  offending layers raised and return that result), ``raise`` (GuardError naming the layer).
- ``layers``: absent: the GEMM layers whose output dtype has a small range — fp16, or a
  GEMM format (fp8 / mxfp8 / nvfp4) in a fp16 region; bf16 / tf32 / fp32 share fp32's
  range, and an overflow there would overflow fp32 too. ``all``: every GEMM layer. A list:
  those paths (checked against the model at apply).
- ``fallback``: absent for a layer: the nearest wider-range precision (bf16, tf32, fp32)
  that the policy's ``reasons`` for it do not refuse and the device runs; fp32 at worst.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autoprec.errors import PolicyError
from autoprec.formats.precisions import REGIONS
from autoprec.io.fileio import brief
from autoprec.io.paths import normalize_path

#: The guard's modes, from no checks to an error.
GUARD_MODES: tuple[str, ...] = ("off", "detect", "fallback", "raise")
#: ``layers: all``: every GEMM layer, whatever its format's range.
ALL = "all"
_KEYS = ("mode", "layers", "fallback")


@dataclass(frozen=True)
class GuardSpec:
    """A parsed ``guard`` key. ``layers``: None (the small-range layers), ``"all"``, or a
    tuple of module paths; ``fallback``: path -> region precision."""

    mode: str = "off"
    layers: tuple[str, ...] | str | None = None
    fallback: dict[str, str] = field(default_factory=dict)

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def to_yaml(self) -> str | dict[str, Any] | None:
        """What ``Policy.to_dict`` writes: None (off, nothing else set), the mode alone,
        or the mapping."""
        if self.layers is None and not self.fallback:
            return None if self.mode == "off" else self.mode
        out: dict[str, Any] = {"mode": self.mode}
        if self.layers is not None:
            out["layers"] = self.layers if isinstance(self.layers, str) else list(self.layers)
        if self.fallback:
            out["fallback"] = dict(self.fallback)
        return out


def _fail(source: str, key: str, rule: str) -> PolicyError:
    return PolicyError(f"{source}: {key}: {rule}")


def parse_guard(source: str, value: Any) -> GuardSpec:
    """A ``guard`` value (None, a mode, a mapping or a GuardSpec) checked; PolicyError
    names the key (``FILE: guard.layers[1]: …``)."""
    if value is None:
        return GuardSpec()
    if isinstance(value, GuardSpec):
        value = value.to_yaml()
        if value is None:
            return GuardSpec()
    if isinstance(value, str):
        value = {"mode": value}
    if not isinstance(value, Mapping):
        raise _fail(source, "guard", f"must be a mode ({', '.join(GUARD_MODES)}) or a mapping "
                                     f"{{mode, layers, fallback}}, got {brief(value)}")
    for k in value:
        if k not in _KEYS:
            raise _fail(source, f"guard.{k}", f"unknown key; expected one of {', '.join(_KEYS)}")
    mode = value.get("mode", "detect")
    if not isinstance(mode, str) or mode not in GUARD_MODES:
        raise _fail(source, "guard.mode", f"must be one of {', '.join(GUARD_MODES)}, "
                                          f"got {brief(mode)}")
    layers = value.get("layers")
    if layers is not None and layers != ALL:
        if not isinstance(layers, list):
            raise _fail(source, "guard.layers", f"must be a list of module paths or "
                                                f"{ALL!r}, got {brief(layers)}")
        paths = []
        for i, p in enumerate(layers):
            if isinstance(p, bool) or not isinstance(p, (str, int)):
                raise _fail(source, f"guard.layers[{i}]",
                            f"a module path must be a string, got {brief(p)}")
            paths.append(normalize_path(str(p)))
        layers = tuple(dict.fromkeys(paths))
    fallback: dict[str, str] = {}
    raw = value.get("fallback")
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise _fail(source, "guard.fallback", f"must be a mapping of module path to "
                                                  f"precision, got {brief(raw)}")
        for p, prec in raw.items():
            key = f"guard.fallback[{brief(str(p))}]"
            if not isinstance(prec, str) or prec not in REGIONS:
                raise _fail(source, key, f"must be one of {', '.join(REGIONS)} (a layer "
                                         f"re-runs in a region precision), got {brief(prec)}")
            fallback[normalize_path(str(p))] = prec
    return GuardSpec(mode, layers, fallback)


__all__ = ["ALL", "GUARD_MODES", "GuardSpec", "parse_guard"]
