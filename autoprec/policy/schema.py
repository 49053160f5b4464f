"""The policy file (YAML, schema 1): the dataclass, loading with validation, atomic saving.

A policy is a plain map from module path to precision with a documented precedence (the
most specific path wins; the compiled plan decides it, ``autoprec.plan.compile``), plus
what a reviewer needs to trust it: the model's fingerprint, the target its speed figures
refer to, reasons, metrics, provenance.

Validation names the first problem as ``FILE: KEY: rule``, e.g.
``p.yaml: layers['enc.0.q']: unknown precision 'fp12'; expected one of fp32, …``. Checks
that need the model (paths, fingerprint, fp8 eligibility) live in modules.py and run when
``load_policy`` is given one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from autoprec.errors import FingerprintMismatch, PolicyError, PolicyWarning
from autoprec.fileio import MiB, atomic_write, brief, read_regular
from autoprec.paths import normalize_path
from autoprec.policy.guard_spec import GuardSpec, parse_guard
from autoprec.policy.modules import check_model
from autoprec.precisions import FORMS, GEMM_FORMATS, LEGACY_FORM, PRECISIONS
from autoprec.validate import MAX_BATCH_SIZE

#: The schema version this autoprec reads and writes.
SCHEMA_VERSION = 1

#: Top-level keys in the order they are written.
KEYS = ("autoprec_policy", "model", "reference", "target", "form", "guard", "default",
        "layers", "locked", "reasons", "metrics", "provenance")
REQUIRED = ("autoprec_policy", "default")  # no `layers`: no rules
_MODEL_KEYS = ("name", "fingerprint")
#: ``reference:`` — the model as given, what errors and speed-ups "over the model" refer
#: to (autoprec.reference): the dtype most weights are stored in and the modules stored
#: in another. Absent: an fp32 model (every file written before 16-bit models were tuned).
_REFERENCE_KEYS = ("dtype", "layers")
_REFERENCE_DTYPES = ("fp32", "bf16", "fp16")
_TARGET_KEYS = ("device", "batch_size", "mode")
#: Deployment modes a policy's speed figures refer to (target.mode; absent: eager).
MODES = ("eager", "compile")
#: Metrics with a fixed type; others may be any scalar.
_NUMBER_METRICS = ("error", "metric_drop", "budget", "est_speedup")
_BOOL_METRICS = ("feasible",)

#: A policy is a reviewed artifact that CI gates load: its size and shape are bounded
#: before anything is built from it. A policy of a 10,000-layer model with reasons is
#: about 1.2 MiB (PyYAML reads ~1 MiB/s); it nests 3 levels (provenance mappings 4).
MAX_POLICY_BYTES = 4 * MiB
MAX_DEPTH = 16
#: Integers in a policy are versions, batch sizes and counts: a 40-digit one is a typo,
#: and a 5000-digit one would hit Python's int/str conversion limit.
MAX_INT_DIGITS = 40
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}\Z")


@dataclass
class Policy:
    """A per-layer precision assignment (schema 1).

    ``layers`` maps normalised module paths to precisions; a rule covers the module and
    its children, the most specific path wins, ``default`` covers the rest. ``source``
    names the file it came from in error messages and is not written.
    """

    default: str = "fp32"
    layers: dict[str, str] = field(default_factory=dict)
    #: how the plan runs (``precisions.FORMS``): "deploy" (weights stored in each layer's
    #: precision, no autocast) or "train" (autocast over fp32 masters; a file without
    #: ``form:`` means this, as it did before the deploy form existed)
    form: str = LEGACY_FORM
    #: the run-time check of a deployed plan (``policy.guard_spec``; absent: off); a mode
    #: name or a mapping is accepted here and parsed into a GuardSpec
    guard: GuardSpec = field(default_factory=GuardSpec)
    model: dict[str, str] = field(default_factory=dict)  # {name, fingerprint}
    #: the model as given (``{dtype: bf16, layers: {path: fp32}}``); empty: fp32
    reference: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)  # {device, batch_size, mode}
    locked: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    source: str = "<policy>"

    def __post_init__(self) -> None:
        # Built in code, a policy is checked as strictly as one read from a file, and
        # normalised the same way (wrapper prefixes, None members dropped, a target name
        # becomes {device: name}).
        checked = _parse(self.to_dict(), self.source)
        for name in ("guard", "layers", "model", "reference", "target", "locked", "reasons",
                     "metrics", "provenance"):
            setattr(self, name, getattr(checked, name))

    @property
    def fingerprint(self) -> str | None:
        return self.model.get("fingerprint")

    @property
    def model_name(self) -> str | None:
        return self.model.get("name")

    @property
    def target_device(self) -> str | None:
        return self.target.get("device")

    @property
    def batch_size(self) -> int | None:
        """The deployment batch size the speed figures assume (target.batch_size)."""
        return self.target.get("batch_size")

    @property
    def mode(self) -> str:
        """How the model is deployed (target.mode): "eager" (the default) or "compile"
        (``torch.compile``, inductor): what the speed figures were priced for."""
        return self.target.get("mode", "eager")

    # -- conversions -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The YAML document, keys in schema order, optional sections only when set."""
        out: dict[str, Any] = {"autoprec_policy": SCHEMA_VERSION}
        for key in ("model", "reference", "target"):
            value = getattr(self, key)
            if isinstance(value, Mapping):
                value = {k: v for k, v in value.items() if v is not None}
            if value:
                out[key] = value
        out["form"] = self.form
        # a str / mapping given in code is written as is: _parse checks it
        guard = self.guard.to_yaml() if isinstance(self.guard, GuardSpec) else self.guard
        if guard is not None:
            out["guard"] = guard
        out["default"] = self.default
        out["layers"] = dict(self.layers)
        for key in ("locked", "reasons", "metrics", "provenance"):
            value = getattr(self, key)
            if value:
                out[key] = list(value) if key == "locked" else dict(value)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "<policy>") -> Policy:
        """Validate a parsed YAML document; PolicyError names the first problem."""
        return _parse(data, source)

    def dumps(self) -> str:
        """The policy as YAML text (what ``save`` writes)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False,
                              allow_unicode=True)

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temp file in the same folder, fsync, then ``os.replace``.

        A reader never sees a half-written policy, and a crash or a full disk leaves the
        old file intact (OutputError, exit 2). ``path`` must be a regular file or absent
        (a FIFO or a device is refused); a symlink is followed (see autoprec.fileio).
        """
        path = Path(path)
        atomic_write(path, self.dumps())
        self.source = str(path)
        return path

    # -- queries -----------------------------------------------------------------------
    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision the policy names (default included), in canonical order."""
        used = {self.default, *self.layers.values()}
        return tuple(p for p in PRECISIONS if p in used)

    def validate(self, model: torch.nn.Module, force: bool = False) -> None:
        """Check the policy against ``model`` (paths, fingerprint, fp8 eligibility, shared
        modules); see ``modules.check_model``.

        A fingerprint mismatch raises FingerprintMismatch unless ``force``; then it warns.
        """
        check_model(self, model, force=force)


def load_policy(path: str | Path, model: torch.nn.Module | None = None,
                force: bool = False) -> Policy:
    """Read a policy file (safe YAML only) and validate it; with ``model``, against it too.

    Raises PolicyError (exit 2) naming the file, the key and the rule of the first
    problem. A missing fingerprint warns (hand-written policies are normal); a mismatched
    one raises FingerprintMismatch unless ``force``, which downgrades it to a warning.
    """
    path = Path(path)
    blob = read_regular(path, MAX_POLICY_BYTES, "policy file", PolicyError)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as err:
        line = blob.count(b"\n", 0, err.start) + 1
        raise PolicyError(f"{path}:{line}: not UTF-8 text (byte {err.start}): a policy is a "
                          "YAML text file") from None
    policy = loads_policy(text, source=str(path))
    if model is not None:
        policy.validate(model, force=force)
    return policy


class _PolicyLoader(yaml.SafeLoader):
    """yaml.safe_load, bounded and strict: no aliases (``*name`` — an alias bomb of a few
    hundred bytes expands to gigabytes), at most MAX_DEPTH levels of nesting (deeper ones
    would exhaust the recursion of PyYAML's composer), integers of at most MAX_INT_DIGITS
    digits, keys that are scalars, and no key given twice in one mapping (a reviewer
    reading ``layers`` top-down must see the rule that applies)."""

    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{brief(event.anchor)[1:-1]}: a policy may not use YAML "
                "aliases (write the value out)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"a key is {kind}; keys must be plain names (module paths are strings)",
                    key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {brief(key)} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):  # type: ignore[no-untyped-def]
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits (at most {MAX_INT_DIGITS})",
                node.start_mark)
        return super().construct_yaml_int(node)


_PolicyLoader.add_constructor("tag:yaml.org,2002:int", _PolicyLoader.construct_yaml_int)


def loads_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse policy YAML text; ``source`` names it in messages."""
    if len(text) > MAX_POLICY_BYTES:
        raise PolicyError(f"{source}: larger than a policy may be "
                          f"({MAX_POLICY_BYTES // MiB} MiB)")
    try:
        data = yaml.load(text, Loader=_PolicyLoader)  # safe_load, bounded (see the loader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        what = err.problem or err.context or "syntax error"
        if isinstance(err, yaml.constructor.ConstructorError) and err.problem and \
                "could not determine a constructor" in err.problem:
            what += " (policies are plain YAML, read with yaml.safe_load: no tags)"
        raise PolicyError(f"{where}: not valid YAML: {what}") from None
    except yaml.reader.ReaderError as err:  # a NUL byte, a control character
        line = text.count("\n", 0, err.position) + 1
        col = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        char = f"#x{err.character:04x}" if isinstance(err.character, int) else \
            brief(err.character)
        raise PolicyError(f"{source}:{line}:{col}: not valid YAML: character {char} is not "
                          "allowed in a YAML file") from None
    except yaml.YAMLError as err:
        raise PolicyError(f"{source}: not valid YAML: {brief(str(err))}") from None
    return _parse(data, source)


# -- validation --------------------------------------------------------------------------

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
    """``reference: {dtype: bf16, layers: {path: fp32}}`` (module doc of autoprec.reference)."""
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


def _parse(data: Any, source: str) -> Policy:
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

    policy = Policy.__new__(Policy)  # already checked: skip __post_init__'s re-parse
    policy.default = default
    policy.form = form
    policy.guard = guard
    policy.layers = layers
    policy.model = model
    policy.reference = reference
    policy.target = target
    policy.locked = locked
    policy.reasons = reasons
    policy.metrics = metrics
    policy.provenance = provenance
    policy.source = source
    return policy


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


__all__ = ["FingerprintMismatch", "Policy", "PolicyWarning", "SCHEMA_VERSION",
           "load_policy", "loads_policy"]
