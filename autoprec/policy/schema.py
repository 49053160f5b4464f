"""The policy file (YAML, schema 1): the dataclass, loading with validation, atomic saving.

A policy is a plain map from module path to precision with a documented precedence (the
most specific path wins; the compiled plan decides it, ``autoprec.plan.compile``), plus
what a reviewer needs to trust it: the model's fingerprint, the target its speed figures
refer to, reasons, metrics, provenance.

Reading is two steps beside this file: ``yaml_loader`` (safe YAML, bounded) and
``validation`` (every key checked; the first problem named as ``FILE: KEY: rule``). Checks
that need the model (paths, fingerprint, fp8 eligibility) live in modules.py and run when
``load_policy`` is given one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from autoprec.errors import FingerprintMismatch, PolicyError, PolicyWarning
from autoprec.formats.precisions import LEGACY_FORM, PRECISIONS
from autoprec.io.fileio import atomic_write, read_regular
from autoprec.policy.guard_spec import GuardSpec
from autoprec.policy.modules import check_model
from autoprec.policy.validation import KEYS, MODES, REQUIRED, SCHEMA_VERSION, parse_fields
from autoprec.policy.yaml_loader import MAX_POLICY_BYTES, read_yaml


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
    #: whether the file wrote ``form:`` (False: a file from before the deploy form, read as
    #: "train"; its speed figures are the forward's, and ``pricing.target`` prices it so)
    form_written: bool = field(default=True, compare=False, repr=False)
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
        checked = parse_fields(self.to_dict(), self.source)
        for name in ("guard", "layers", "model", "reference", "target", "locked", "reasons",
                     "metrics", "provenance"):
            setattr(self, name, checked[name])

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
        fields = parse_fields(data, source)
        policy = cls.__new__(cls)  # already checked: skip __post_init__'s re-parse
        for name in ("default", "form", "guard", "layers", "model", "reference", "target",
                     "locked", "reasons", "metrics", "provenance"):
            setattr(policy, name, fields[name])
        policy.form_written = isinstance(data, dict) and "form" in data
        policy.source = source
        return policy

    def dumps(self) -> str:
        """The policy as YAML text (what ``save`` writes)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False,
                              allow_unicode=True)

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temp file in the same folder, fsync, then ``os.replace``.

        A reader never sees a half-written policy, and a crash or a full disk leaves the
        old file intact (OutputError, exit 2). ``path`` must be a regular file or absent
        (a FIFO or a device is refused); a symlink is followed (see autoprec.io.fileio).
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


def loads_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse policy YAML text; ``source`` names it in messages."""
    return Policy.from_dict(read_yaml(text, source), source)


__all__ = ["KEYS", "MAX_POLICY_BYTES", "MODES", "REQUIRED", "FingerprintMismatch", "Policy",
           "PolicyWarning", "SCHEMA_VERSION", "load_policy", "loads_policy"]
