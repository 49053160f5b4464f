"""Validation of a policy document (schema 1): every key and value checked and normalised.

``parse_fields`` takes the data of a policy file (or of a ``Policy`` built in code, which is
checked as strictly) and returns the fields of a ``Policy``, or raises a PolicyError naming
the first problem as ``FILE: KEY: rule``, e.g.
``p.yaml: layers['enc.0.q']: unknown precision 'fp12'; expected one of fp32, …``. Checks that
need the model (paths, fingerprint, fp8 eligibility) live in ``policy.modules``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from autoprec.errors import PolicyError
from autoprec.formats.precisions import FORMS, GEMM_FORMATS, LEGACY_FORM, PRECISIONS
from autoprec.io.fileio import brief
from autoprec.io.paths import normalize_path
from autoprec.io.validate import MAX_BATCH_SIZE
from autoprec.policy.guard_spec import parse_guard

#: The schema version this autoprec reads and writes.
SCHEMA_VERSION = 1

#: Top-level keys in the order they are written.
KEYS = ("autoprec_policy", "model", "reference", "target", "form", "guard", "default",
        "layers", "locked", "reasons", "metrics", "provenance")
REQUIRED = ("autoprec_policy", "default")  # no `layers`: no rules
_MODEL_KEYS = ("name", "fingerprint")
#: ``reference:`` — the model as given, what errors and speed-ups "over the model" refer
#: to (autoprec.workload.reference): the dtype most weights are stored in and the modules stored
#: in another. Absent: an fp32 model (every file written before 16-bit models were tuned).
_REFERENCE_KEYS = ("dtype", "layers")
_REFERENCE_DTYPES = ("fp32", "bf16", "fp16")
_TARGET_KEYS = ("device", "batch_size", "mode")
#: Deployment modes a policy's speed figures refer to (target.mode; absent: eager).
MODES = ("eager", "compile")
#: Metrics with a fixed type; others may be any scalar.
_NUMBER_METRICS = ("error", "metric_drop", "budget", "est_speedup")
_BOOL_METRICS = ("feasible",)

_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}\Z")


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "empty"}.get(
        type(value), type(value).__name__)


def _name(key: Any) -> str:
    """A key as it appears in a message: unquoted, at most about 80 characters."""
    return brief(key)[1:-1] if isinstance(key, str) else brief(key)


def _fail(source: str, key: str, rule: str) -> PolicyError:
    return PolicyError(f"{source}: {key}: {rule}")


def _precision(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(source, key, f"must be a precision name (one of {', '.join(PRECISIONS)}), "
                                 f"got {_type_name(value)} {brief(value)}")
    if value not in PRECISIONS:
        raise _fail(source, key, f"unknown precision {brief(value)}; expected one of "
                                 f"{', '.join(PRECISIONS)}")
    return value


def _path_key(source: str, section: str, key: Any) -> str:
    # YAML reads an unquoted `0:` (an nn.Sequential child) as the integer 0: accept ints,
    # refuse floats (`1.10` would silently become "1.1").
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise _fail(source, f"{section}[{brief(key)}]",
                    f"a module path must be a string; quote it ('{_name(key)}')")
    return normalize_path(str(key))


def _mapping(source: str, key: str, value: Any, allow_empty: bool = False) -> dict[Any, Any]:
    if value is None and allow_empty:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(source, key, f"must be a mapping, got {_type_name(value)}")
    return dict(value)


def _unknown_keys(source: str, where: str, got: Mapping[Any, Any],
                  known: tuple[str, ...]) -> None:
    for k in got:
        if k not in known:
            loc = f"{where}.{_name(k)}" if where else _name(k)
            raise _fail(source, loc, f"unknown key; expected one of {', '.join(known)}")


def _parse_reference(source: str, value: Any) -> dict[str, Any]:
    """``reference: {dtype: bf16, layers: {path: fp32}}`` (module doc of autoprec.workload.reference)."""
    if value is None:
        return {}
    raw = _mapping(source, "reference", value)
    _unknown_keys(source, "reference", raw, _REFERENCE_KEYS)
    dtype = raw.get("dtype", "fp32")
    if not isinstance(dtype, str) or dtype not in _REFERENCE_DTYPES:
        raise _fail(source, "reference.dtype", f"must be one of {', '.join(_REFERENCE_DTYPES)} "
                                               f"(the dtype of the model's weights), got "
                                               f"{brief(dtype)}")
    out: dict[str, Any] = {"dtype": dtype}
    layers = {}
    for raw_path, prec in _mapping(source, "reference.layers", raw.get("layers"),
                                   allow_empty=True).items():
        path = _path_key(source, "reference.layers", raw_path)
        if not isinstance(prec, str) or prec not in _REFERENCE_DTYPES:
            raise _fail(source, f"reference.layers[{brief(str(raw_path))}]",
                        f"must be one of {', '.join(_REFERENCE_DTYPES)}, got {brief(prec)}")
        layers[path] = prec
    if layers:
        out["layers"] = layers
    return out if dtype != "fp32" or layers else {}


def parse_fields(data: Any, source: str) -> dict[str, Any]:
    """The fields of a ``Policy`` from a parsed YAML document, checked and normalised;
    PolicyError names the first problem."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: a policy must be a YAML mapping at the top level, "
                          f"got {_type_name(data)}")
    _unknown_keys(source, "", data, KEYS)
    for k in REQUIRED:
        if k not in data:
            raise _fail(source, k, "required key is missing")
    version = data["autoprec_policy"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise _fail(source, "autoprec_policy", f"must be the schema version (an integer), "
                                               f"got {_type_name(version)} {brief(version)}")
    if version != SCHEMA_VERSION:
        raise _fail(source, "autoprec_policy", f"unknown schema version {version}; this "
                                               f"autoprec reads version {SCHEMA_VERSION}")

    model: dict[str, str] = {}
    if data.get("model") is not None:
        raw_model = _mapping(source, "model", data["model"])
        _unknown_keys(source, "model", raw_model, _MODEL_KEYS)
        for k in _MODEL_KEYS:
            v = raw_model.get(k)
            if v is None:
                continue
            if not isinstance(v, str):
                raise _fail(source, f"model.{k}", f"must be a string, got {_type_name(v)}")
            model[k] = v
        fp = model.get("fingerprint")
        if fp is not None and not _FINGERPRINT.match(fp):
            raise _fail(source, "model.fingerprint", "must look like 'sha256:<hex>' (64 "
                                                     f"lowercase hex digits), got {brief(fp)}")

    reference = _parse_reference(source, data.get("reference"))
    target = _parse_target(source, data.get("target"))

    form = data.get("form", LEGACY_FORM)
    if not isinstance(form, str) or form not in FORMS:
        raise _fail(source, "form", f"must be one of {', '.join(FORMS)} (deploy: weights "
                                    "stored in each layer's precision; train: autocast over "
                                    f"fp32 masters), got {brief(form)}")

    guard = parse_guard(source, data.get("guard"))
    default = _precision(source, "default", data["default"])
    if default in GEMM_FORMATS:
        raise _fail(source, "default",
                    f"{default} cannot be the default: it applies only to {default}-eligible "
                    "Linear layers; set the default for everything else and add a rule "
                    f"'': {default} (the root) to put every eligible layer in {default}")

    layers: dict[str, str] = {}
    seen: dict[str, Any] = {}
    for raw, prec in _mapping(source, "layers", data.get("layers"), allow_empty=True).items():
        path = _path_key(source, "layers", raw)
        key = f"layers[{brief(str(raw))}]"
        if path in layers:
            raise _fail(source, key, f"duplicates layers[{brief(seen[path])}] once wrapper "
                                     "prefixes (_orig_mod., module.) are removed")
        layers[path] = _precision(source, key, prec)
        seen[path] = str(raw)

    locked: list[str] = []
    if data.get("locked") is not None:
        raw_locked = data["locked"]
        if not isinstance(raw_locked, list):
            raise _fail(source, "locked", f"must be a list of module paths, got "
                                          f"{_type_name(raw_locked)}")
        for i, p in enumerate(raw_locked):
            locked.append(_path_key(source, f"locked[{i}]", p))

    reasons: dict[str, str] = {}
    for raw, why in _mapping(source, "reasons", data.get("reasons"), allow_empty=True).items():
        path = _path_key(source, "reasons", raw)
        if not isinstance(why, str):
            raise _fail(source, f"reasons[{brief(str(raw))}]",
                        f"must be a string, got {_type_name(why)}")
        reasons[path] = why

    metrics = _mapping(source, "metrics", data.get("metrics"), allow_empty=True)
    for k, v in metrics.items():
        _check_metric(source, k, v)

    provenance = _mapping(source, "provenance", data.get("provenance"), allow_empty=True)
    for k, v in provenance.items():
        if not isinstance(k, str):
            raise _fail(source, f"provenance[{brief(k)}]", "keys must be strings")
        if not _is_plain(v):
            raise _fail(source, f"provenance.{_name(k)}", f"must be a scalar, list or mapping of "
                                                   f"scalars, got {_type_name(v)}")

    return {"default": default, "form": form, "guard": guard, "layers": layers, "model": model,
            "reference": reference, "target": target, "locked": locked, "reasons": reasons,
            "metrics": metrics, "provenance": provenance}


def _parse_target(source: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"device": value}
    if not isinstance(value, Mapping):
        raise _fail(source, "target", f"must be a device name or a mapping "
                                      f"{{device, batch_size, mode}}, got {_type_name(value)}")
    _unknown_keys(source, "target", value, _TARGET_KEYS)
    device, batch = value.get("device"), value.get("batch_size")
    if device is not None and not isinstance(device, str):
        raise _fail(source, "target.device", f"must be a string, got {_type_name(device)}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or batch < 1):
        raise _fail(source, "target.batch_size",
                    f"must be a positive integer, got {brief(batch)}")
    if batch is not None and batch > MAX_BATCH_SIZE:
        raise _fail(source, "target.batch_size",
                    f"must be at most {MAX_BATCH_SIZE}, got {brief(batch)}")
    mode = value.get("mode")
    if mode is not None and (not isinstance(mode, str) or mode not in MODES):
        raise _fail(source, "target.mode",
                    f"must be one of {', '.join(MODES)}, got {brief(mode)}")
    return {k: v for k, v in (("device", device), ("batch_size", batch), ("mode", mode))
            if v is not None}


def _check_metric(source: str, key: Any, value: Any) -> None:
    if not isinstance(key, str):
        raise _fail(source, f"metrics[{brief(key)}]", "keys must be strings")
    where = f"metrics.{_name(key)}"
    if key in _NUMBER_METRICS:
        # .inf is how YAML writes an infeasible error; null means "not measured".
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, (int, float))):
            raise _fail(source, where, f"must be a number, got {_type_name(value)} {brief(value)}")
    elif key in _BOOL_METRICS:
        if value is not None and not isinstance(value, bool):
            raise _fail(source, where, f"must be true or false, got {brief(value)}")
    elif not _is_scalar(value):
        raise _fail(source, where, f"must be a scalar, got {_type_name(value)}")


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _is_plain(v: Any) -> bool:
    if _is_scalar(v):
        return True
    if isinstance(v, list):
        return all(_is_scalar(x) for x in v)
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _is_scalar(x) for k, x in v.items())
    return False



__all__ = ["KEYS", "MODES", "REQUIRED", "SCHEMA_VERSION", "parse_fields"]
