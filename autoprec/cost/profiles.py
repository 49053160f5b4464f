"""Device profiles: what a *target* device can run and how fast (datasheet peaks + factors).

``autoprec.device.capability`` answers "can *this* machine run fp8 here?"; a profile answers the
same question for the device a policy is tuned for, so that a laptop can tune for an H100.
The figures live in ``devices.yaml`` beside this file, each with its source. Measured
efficiency factors (``autoprec.cost.calibrate``) are stored as a small YAML file that
overrides the profile's factors: ``get_profile("h200", calibration="h200.cal.yaml")``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from autoprec.errors import InputError

# autoprec.formats.precisions (which imports torch) is imported where a profile is built or asked:
# reading the profile names (``profile_names``, every command's --target help) needs no torch

#: The profiles shipped with autoprec.
DEVICES_FILE = Path(__file__).with_name("devices.yaml")
PROFILE_SCHEMA = 1
CALIBRATION_SCHEMA = 1


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline figures of one device. Rates in SI units (FLOP/s, bytes/s, seconds)."""

    name: str  # profile key, e.g. "h100"
    description: str
    source: str
    peak_flops: Mapping[str, float | None]  # precision -> dense FLOP/s; None: unsupported
    memory_bw: float  # bytes/s
    launch_overhead_s: float  # per kernel launch
    efficiency: Mapping[str, float] = field(default_factory=dict)  # precision -> factor
    memory_efficiency: float = 1.0
    gemm_setup_s: Mapping[str, float] = field(default_factory=dict)  # per GEMM call
    unsupported: Mapping[str, str] = field(default_factory=dict)  # precision -> reason
    calibrated_from: str = ""  # calibration file applied, if any
    #: The deployment mode its factors were measured in ("eager", or "compile": fitted on
    #: compiled micro-benchmarks) and, compiled, the seconds per forward outside the
    #: kernels (dynamo's guards, the compiled wrapper's Python).
    mode: str = "eager"
    call_overhead_s: float = 0.0

    def supports(self, precision: str) -> tuple[bool, str]:
        """``(ok, reason)``: can this device compute in ``precision``?"""
        from autoprec.formats.precisions import check_precision

        check_precision(precision)
        if self.peak_flops.get(precision) is not None:
            return True, ""
        reason = self.unsupported.get(precision)
        if not reason:
            reason = f"{precision}: {self.name} has no {precision} compute units ({self.source})"
        return False, reason

    @property
    def precisions(self) -> tuple[str, ...]:
        """Precisions this device runs, in the canonical order."""
        from autoprec.formats.precisions import PRECISIONS

        return tuple(p for p in PRECISIONS if self.peak_flops.get(p) is not None)

    def peak(self, precision: str) -> float:
        """Effective FLOP/s at ``precision`` (peak x efficiency); 0.0 when unsupported."""
        p = self.peak_flops.get(precision)
        return 0.0 if p is None else p * self.efficiency.get(precision, 1.0)

    @property
    def bandwidth(self) -> float:
        """Effective memory bandwidth, bytes/s."""
        return self.memory_bw * self.memory_efficiency

    def setup(self, precision: str) -> float:
        return self.gemm_setup_s.get(precision, 0.0)

    def with_factors(
        self,
        efficiency: Mapping[str, float] | None = None,
        memory_efficiency: float | None = None,
        launch_overhead_s: float | None = None,
        gemm_setup_s: Mapping[str, float] | None = None,
        calibrated_from: str = "",
    ) -> DeviceProfile:
        """A copy with some factors replaced (the datasheet peaks never change)."""
        eff = dict(self.efficiency)
        eff.update(efficiency or {})
        setup = dict(self.gemm_setup_s)
        setup.update(gemm_setup_s or {})
        return dataclasses.replace(
            self,
            efficiency=eff,
            memory_efficiency=self.memory_efficiency if memory_efficiency is None
            else memory_efficiency,
            launch_overhead_s=self.launch_overhead_s if launch_overhead_s is None
            else launch_overhead_s,
            gemm_setup_s=setup,
            calibrated_from=calibrated_from or self.calibrated_from,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "peak_tflops": {p: (None if v is None else v / 1e12)
                            for p, v in self.peak_flops.items()},
            "memory_tbps": self.memory_bw / 1e12,
            "launch_overhead_us": self.launch_overhead_s * 1e6,
            "efficiency": dict(self.efficiency),
            "memory_efficiency": self.memory_efficiency,
            "gemm_setup_us": {p: v * 1e6 for p, v in self.gemm_setup_s.items()},
            "calibrated_from": self.calibrated_from,
            **({"mode": self.mode, "call_overhead_us": self.call_overhead_s * 1e6}
               if self.mode != "eager" else {}),
        }


def _positive(value: Any, what: str, where: str, allow_zero: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: {what} must be a number, but got {value!r}") from None
    ok = (v >= 0.0 if allow_zero else v > 0.0) and math.isfinite(v)
    if not ok:
        rule = ">= 0" if allow_zero else "> 0"
        raise InputError(f"{where}: {what} {rule} must hold, but got {value!r}")
    return v


def _precision_map(raw: Any, what: str, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InputError(f"{where}: {what} must be a mapping precision -> value, got {raw!r}")
    from autoprec.formats.precisions import check_precision

    for p in raw:
        check_precision(str(p), f"{where}: {what}")
    return {str(k): v for k, v in raw.items()}


def _profile_from_dict(key: str, raw: Mapping[str, Any], where: str) -> DeviceProfile:
    from autoprec.formats.precisions import PRECISIONS

    where = f"{where}: device {key!r}"
    for required in ("peak_tflops", "memory_tbps", "launch_overhead_us"):
        if required not in raw:
            raise InputError(f"{where}: missing {required!r}")
    peaks_raw = _precision_map(raw["peak_tflops"], "peak_tflops", where)
    peaks: dict[str, float | None] = {}
    for p in PRECISIONS:
        v = peaks_raw.get(p)
        peaks[p] = None if v is None else _positive(v, f"peak_tflops.{p}", where) * 1e12
    if peaks["fp32"] is None:
        raise InputError(f"{where}: peak_tflops.fp32 is required (fp32 is the reference)")
    eff = {p: _positive(v, f"efficiency.{p}", where)
           for p, v in _precision_map(raw.get("efficiency"), "efficiency", where).items()}
    setup = {p: _positive(v, f"gemm_setup_us.{p}", where, allow_zero=True) * 1e-6
             for p, v in _precision_map(raw.get("gemm_setup_us"), "gemm_setup_us",
                                        where).items()}
    unsupported = {str(p): str(r) for p, r in
                   _precision_map(raw.get("unsupported"), "unsupported", where).items()}
    return DeviceProfile(
        name=key,
        description=str(raw.get("name", key)),
        source=str(raw.get("source", "")),
        peak_flops=peaks,
        memory_bw=_positive(raw["memory_tbps"], "memory_tbps", where) * 1e12,
        launch_overhead_s=_positive(raw["launch_overhead_us"], "launch_overhead_us", where,
                                    allow_zero=True) * 1e-6,
        efficiency=eff,
        memory_efficiency=_positive(raw.get("memory_efficiency", 1.0), "memory_efficiency",
                                    where),
        gemm_setup_s=setup,
        unsupported=unsupported,
    )


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InputError(f"{path}: not valid YAML ({err})") from None


@lru_cache(maxsize=8)
def _load_cached(path: str) -> dict[str, DeviceProfile]:
    data = _read_yaml(Path(path))
    if not isinstance(data, Mapping) or not isinstance(data.get("devices"), Mapping):
        raise InputError(f"{path}: expected a mapping with a 'devices' mapping")
    if data.get("schema") != PROFILE_SCHEMA:
        raise InputError(f"{path}: unknown profile schema {data.get('schema')!r}; "
                         f"expected {PROFILE_SCHEMA}")
    return {str(k): _profile_from_dict(str(k), v, path) for k, v in data["devices"].items()}


def load_profiles(path: str | Path | None = None) -> dict[str, DeviceProfile]:
    """All profiles in ``path`` (default: the shipped ``devices.yaml``), by name."""
    return dict(_load_cached(str(Path(path) if path is not None else DEVICES_FILE)))


def known_devices(path: str | Path | None = None) -> tuple[str, ...]:
    return tuple(load_profiles(path))


def profile_names(path: str | Path | None = None) -> tuple[str, ...]:
    """The profile names in ``path`` (default: the shipped ``devices.yaml``), in the file's
    order, read without building the profiles (no torch): ``known_devices``'s names, for
    the CLI's ``--target`` help."""
    where = Path(path) if path is not None else DEVICES_FILE
    data = _read_yaml(where)
    if not isinstance(data, Mapping) or not isinstance(data.get("devices"), Mapping):
        raise InputError(f"{where}: expected a mapping with a 'devices' mapping")
    return tuple(str(k) for k in data["devices"])


def get_profile(
    name: str,
    calibration: str | Path | None = None,
    profiles_file: str | Path | None = None,
) -> DeviceProfile:
    """The profile called ``name``, with ``calibration``'s measured factors applied.

    Unknown names raise InputError listing the known ones.
    """
    profiles = load_profiles(profiles_file)
    key = name.strip().lower()
    if key not in profiles:
        raise InputError(f"unknown target device {name!r}; known devices: "
                         f"{', '.join(sorted(profiles))}")
    profile = profiles[key]
    if calibration is not None:
        profile = apply_calibration(profile, load_calibration(calibration), source=str(calibration))
    return profile


# --- calibration files ---------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Measured factors for one device (what ``calibrate.fit`` produces)."""

    device: str
    efficiency: Mapping[str, float] = field(default_factory=dict)
    memory_efficiency: float | None = None
    launch_overhead_s: float | None = None
    gemm_setup_s: Mapping[str, float] = field(default_factory=dict)
    n_samples: int = 0
    rel_rmse: float | None = None  # relative RMS error of the fit on its samples
    note: str = ""  # what was measured, where, when
    machine: Mapping[str, Any] = field(default_factory=dict)  # measure.machine.Machine facts
    mode: str = "eager"  # "compile": fitted on torch.compile'd micro-benchmarks
    call_overhead_s: float | None = None  # compiled: seconds per forward outside kernels

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"autoprec_calibration": CALIBRATION_SCHEMA, "device": self.device}
        if self.efficiency:
            out["efficiency"] = {p: round(float(v), 6) for p, v in self.efficiency.items()}
        if self.memory_efficiency is not None:
            out["memory_efficiency"] = round(float(self.memory_efficiency), 6)
        if self.launch_overhead_s is not None:
            out["launch_overhead_us"] = round(float(self.launch_overhead_s) * 1e6, 4)
        if self.gemm_setup_s:
            out["gemm_setup_us"] = {p: round(float(v) * 1e6, 4)
                                    for p, v in self.gemm_setup_s.items()}
        if self.mode != "eager":
            out["mode"] = self.mode
        if self.call_overhead_s is not None:
            out["call_overhead_us"] = round(float(self.call_overhead_s) * 1e6, 4)
        out["n_samples"] = int(self.n_samples)
        if self.rel_rmse is not None:
            out["rel_rmse"] = round(float(self.rel_rmse), 6)
        if self.note:
            out["note"] = self.note
        if self.machine:
            out["machine"] = dict(self.machine)
        return out

    def save(self, path: str | Path) -> Path:
        """Write atomically: a unique temp file in the same folder, fsync, ``os.replace``
        (autoprec.io.fileio); OutputError (exit 2) if it cannot be written, the old file kept."""
        from autoprec.io.fileio import atomic_write

        return atomic_write(Path(path), yaml.safe_dump(self.to_dict(), sort_keys=False))


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    return calibration_from_dict(_read_yaml(path), str(path))


def calibration_from_dict(data: Any, where: str) -> Calibration:
    """The calibration a file's mapping ``data`` (``Calibration.to_dict``'s form) holds.

    ``calibration_from_dict(cal.to_dict(), …)`` is ``cal`` as its cached file reads back
    (factors rounded): what a fresh calibration must be used as, so that the run that
    calibrates and every later run that reads the cache price (and name their study) alike.
    """
    if not isinstance(data, Mapping) or data.get("autoprec_calibration") != CALIBRATION_SCHEMA:
        raise InputError(f"{where}: not an autoprec calibration file "
                         f"(expected 'autoprec_calibration: {CALIBRATION_SCHEMA}')")
    if "device" not in data:
        raise InputError(f"{where}: missing 'device'")
    eff = {p: _positive(v, f"efficiency.{p}", where)
           for p, v in _precision_map(data.get("efficiency"), "efficiency", where).items()}
    setup = {p: _positive(v, f"gemm_setup_us.{p}", where, allow_zero=True) * 1e-6
             for p, v in _precision_map(data.get("gemm_setup_us"), "gemm_setup_us",
                                        where).items()}
    mem = data.get("memory_efficiency")
    launch = data.get("launch_overhead_us")
    call = data.get("call_overhead_us")
    mode = str(data.get("mode", "eager"))
    if mode not in ("eager", "compile"):
        raise InputError(f"{where}: mode: expected 'eager' or 'compile', got {mode!r}")
    return Calibration(
        device=str(data["device"]),
        efficiency=eff,
        memory_efficiency=None if mem is None else _positive(mem, "memory_efficiency", where),
        launch_overhead_s=None if launch is None
        else _positive(launch, "launch_overhead_us", where, allow_zero=True) * 1e-6,
        gemm_setup_s=setup,
        n_samples=int(data.get("n_samples", 0)),
        rel_rmse=data.get("rel_rmse"),
        note=str(data.get("note", "")),
        machine=dict(data["machine"]) if isinstance(data.get("machine"), Mapping) else {},
        mode=mode,
        call_overhead_s=None if call is None
        else _positive(call, "call_overhead_us", where, allow_zero=True) * 1e-6,
    )


def apply_calibration(profile: DeviceProfile, cal: Calibration,
                      source: str = "") -> DeviceProfile:
    """``profile`` with ``cal``'s factors; the device names must match."""
    if cal.device.lower() != profile.name:
        raise InputError(f"calibration is for device {cal.device!r}, "
                         f"but the target is {profile.name!r}")
    out = profile.with_factors(
        efficiency=cal.efficiency,
        memory_efficiency=cal.memory_efficiency,
        launch_overhead_s=cal.launch_overhead_s,
        gemm_setup_s=cal.gemm_setup_s,
        calibrated_from=source or cal.note or "calibration",
    )
    return dataclasses.replace(out, mode=cal.mode, call_overhead_s=cal.call_overhead_s or 0.0)


__all__ = [
    "Calibration",
    "DeviceProfile",
    "apply_calibration",
    "calibration_from_dict",
    "get_profile",
    "known_devices",
    "profile_names",
    "load_calibration",
    "load_profiles",
]
