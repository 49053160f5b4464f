"""Audit an applied policy on a real forward: what every GEMM actually computed in.

A policy says what should happen; autocast decides per op what does. A model's code can
force fp32 (``autocast(enabled=False)``, an explicit ``.float()``), call a layer outside
its parent, or compute its GEMMs functionally. So apply is checked on a real forward:

- module forward pre-/post-hooks keep a stack of the modules executing;
- a ``TorchDispatchMode`` sees every matmul/conv/SDPA *after* autocast has cast its
  operands and attributes the operand dtype to the innermost module (forward hooks alone
  miss functional matmuls such as SDPA or ``q @ k.T``);
- SDPA is judged by the operands it receives (after autocast), at the function level: its
  math fallback (e.g. T5's float position bias on CPU) upcasts bf16 to fp32 inside the
  kernel, an implementation detail like a tensor core's fp32 accumulator, not a rule
  that failed to apply;
- fp32 operands count as tf32 while tf32 is on (CUDA's allow_tf32 flags, or
  lower/forward.py's emulation elsewhere); the fp8 wrapper reports itself through
  ``notify_compute``, since the emulated backend's GEMM runs on dequantised fp32 operands.

A GEMM that did not compute in its rule's precision is an error; a lowering rule that
reaches no GEMM (a norm alone stays fp32 under autocast) is a warning.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec.errors import CheckFailed
from autoprec.formats.precisions import PRECISIONS
from autoprec.fused import FUSED_OPS, has_fused_paths
from autoprec.io.paths import normalize_path, unwrap_model
from autoprec.lower.forward import tf32_emulation_active
from autoprec.policy.modules import Resolved, is_gemm_leaf
from autoprec.policy.schema import Policy, PolicyWarning

#: aten ops that are GEMMs/convolutions (after decomposition: linear -> addmm, matmul ->
#: mm/bmm, einsum -> bmm). SDPA's fused kernels are matched by name prefix below.
_GEMM_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "convolution",
    "_convolution", "_scaled_mm", "mkldnn_convolution", "cudnn_convolution",
})
_CONV_OPS = frozenset({"convolution", "_convolution", "mkldnn_convolution",
                       "cudnn_convolution"})
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                          "float8_e5m2fnuz") if hasattr(torch, n))
_ORDER = {p: i for i, p in enumerate(PRECISIONS)}


class AuditError(CheckFailed):
    """A GEMM did not compute in the precision its rule asked for (exit code 1)."""


@dataclass(frozen=True)
class AuditRow:
    """One GEMM-bearing module: what its rule asked for and what its GEMMs ran in."""

    layer: str
    rule: str  # the deciding rule's path, or "<default>"
    expected: str
    computed: str  # comma-joined precisions seen; "-" when it did not run
    gemms: int  # GEMM/conv ops it executed

    @property
    def ok(self) -> bool:
        return self.computed in ("-", self.expected)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "rule": self.rule, "expected": self.expected,
                "computed": self.computed, "gemms": self.gemms, "ok": self.ok}


@dataclass
class AuditReport:
    """Rows for every GEMM-bearing module, plus the errors and warnings they imply."""

    rows: list[AuditRow]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    result: Any = None  # what ``run()`` returned
    casts: int = 0  # dtype conversions the forward ran (outside fp8 leaves), weights included
    #: what was installed (``audit_policy`` fills these): each module path's resolution
    #: (``policy.modules.Resolved``) and the fp8 backend the plan ran with
    layers: dict[str, Any] = field(default_factory=dict)
    fp8_backend: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_for_errors(self) -> None:
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise AuditError(self.errors[0] + more)

    def to_frame(self):  # -> pandas.DataFrame (pandas is for the boundary: imported here)
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.rows],
                            columns=["layer", "rule", "expected", "computed", "gemms", "ok"])


# -- recording ---------------------------------------------------------------------------

_ACTIVE: list[_Recorder] = []


def notify_compute(precision: str) -> None:
    """Called by the fp8 wrapper on every call: credit the executing module with fp8."""
    if _ACTIVE:
        _ACTIVE[-1].credit(precision)


def _float_dtypes(obj: Any, out: set[torch.dtype]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.add(obj.dtype)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _float_dtypes(v, out)


def _classify(name: str, args: tuple[Any, ...], device: str) -> str | None:
    """The precision a GEMM op computes in, from its floating operands' dtypes."""
    dtypes: set[torch.dtype] = set()
    _float_dtypes(args, dtypes)
    return gemm_precision(dtypes, name, device)


def gemm_precision(dtypes: set[torch.dtype], name: str, device_type: str) -> str | None:
    """The precision a GEMM with floating operands of ``dtypes`` computes in on
    ``device_type`` (a tensor's ``device.type``: "cuda" reads torch's TF32 flags)."""
    if any(d in _FP8 for d in dtypes):
        return "fp8"
    if torch.float16 in dtypes:
        return "fp16"
    if torch.bfloat16 in dtypes:
        return "bf16"
    if torch.float32 in dtypes:
        if device_type == "cuda":
            on = (torch.backends.cudnn.allow_tf32 if name in _CONV_OPS
                  else torch.backends.cuda.matmul.allow_tf32)
            return "tf32" if on else "fp32"
        return "tf32" if tf32_emulation_active() else "fp32"
    if torch.float64 in dtypes:
        return "fp64"
    return None


def _first_device(args: tuple[Any, ...]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


_SDPA = torch.nn.functional.scaled_dot_product_attention


class _SdpaAsOneOp(TorchFunctionMode):
    """Records SDPA at the function level (what autocast hands it) and hides its inside."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is not _SDPA or not self.rec.stack or self.rec.stack[-1][1]:
            return func(*args, **kwargs)
        q = args[0] if args else kwargs["query"]
        dev = q.device.type
        if torch.is_autocast_enabled(dev):  # SDPA is on autocast's lower-precision list
            prec = gemm_precision({torch.get_autocast_dtype(dev)}, "sdpa", dev)
        else:
            prec = _classify("sdpa", tuple(args[:3]), dev)
        if prec is not None:
            self.rec.seen[self.rec.stack[-1][0]][prec] += 1
        self.rec.inside_sdpa += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.rec.inside_sdpa -= 1


class _Recorder(TorchDispatchMode):
    """Attributes each GEMM's operand precision to the innermost executing module."""

    def __init__(self, owners: dict[int, tuple[frozenset[str], tuple[str, ...]]]) -> None:
        super().__init__()
        #: storage address of a GEMM leaf's parameter -> (every module owning it, the GEMM
        #: leaves among them): an op reading it while no owner runs bypassed the leaf.
        self.owners = owners
        self.bypassed: dict[str, set[tuple[str, str]]] = defaultdict(set)  # leaf -> (by, op)
        self.stack: list[list[Any]] = []  # [path, credited_fp8]
        self.seen: dict[str, Counter[str]] = defaultdict(Counter)  # path -> GEMM precisions
        self.ran: set[str] = set()
        self.inside_sdpa = 0
        self.casts = 0

    def credit(self, precision: str) -> None:
        if self.stack:
            frame = self.stack[-1]
            frame[1] = True
            self.seen[frame[0]][precision] += 1

    def _check_bypass(self, name: str, args: tuple[Any, ...]) -> None:
        """Record GEMM leaves whose weights this op reads while the leaf is not running."""
        running = None
        for a in args:
            if not isinstance(a, torch.Tensor) or a.is_nested:
                continue
            try:
                entry = self.owners.get(a.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without plain storage
                continue
            if entry is None:
                continue
            if running is None:
                running = {frame[0] for frame in self.stack}
            every, leaves = entry
            if not running & every:
                by = self.stack[-1][0] if self.stack else ""
                for leaf in leaves:
                    self.bypassed[leaf].add((by, name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if self.owners and (name in _GEMM_OPS or name in FUSED_OPS or name == "_to_copy"):
            self._check_bypass(name, args)  # a GEMM on (a cast of) a leaf's weight
        if name == "_to_copy" and not (self.stack and self.stack[-1][1]):
            out = func(*args, **(kwargs or {}))
            if args and isinstance(args[0], torch.Tensor) and args[0].dtype != out.dtype:
                self.casts += 1  # what the plan's schedule counts (casts + weight casts)
            return out
        if self.stack and not self.stack[-1][1] and not self.inside_sdpa and (
                name in _GEMM_OPS or name.startswith("_scaled_dot_product")):
            prec = _classify(name, args, _first_device(args))
            if prec is not None:
                self.seen[self.stack[-1][0]][prec] += 1
        return func(*args, **(kwargs or {}))


def _weight_owners(root: torch.nn.Module) -> dict[int, tuple[frozenset[str], tuple[str, ...]]]:
    """Storage address -> (modules owning the tensor, GEMM leaves among them), for the
    parameters of GEMM leaves (a tied embedding counts as an owner: its lookup is no bypass).
    """
    every: dict[int, set[str]] = defaultdict(set)
    leaves: dict[int, list[str]] = defaultdict(list)
    for path, mod in root.named_modules():
        p = normalize_path(path)
        gemm = is_gemm_leaf(mod)
        for t in mod.parameters(recurse=False):
            key = t.untyped_storage().data_ptr()
            every[key].add(p)
            if gemm and p not in leaves[key]:
                leaves[key].append(p)
    return {k: (frozenset(every[k]), tuple(v)) for k, v in leaves.items() if v}


def _hooks(root: torch.nn.Module, rec: _Recorder) -> list[Any]:
    handles = []
    for path, mod in root.named_modules():
        p = normalize_path(path)

        def pre(_m: Any, _a: Any, p: str = p) -> None:
            rec.stack.append([p, False])
            rec.ran.add(p)

        def post(_m: Any, _a: Any, _o: Any) -> None:
            if rec.stack:
                rec.stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


def _fmt(counter: Counter[str]) -> str:
    if not counter:
        return "-"
    return ",".join(sorted(counter, key=lambda p: _ORDER.get(p, -1)))


def audit_run(model: torch.nn.Module, layers: dict[str, Resolved], policy: Policy,
              run: Callable[[], Any], strict: bool = True) -> AuditReport:
    """Run ``run()`` eagerly with recording on; see the module docstring.

    ``layers`` is the resolution of every module path (``PolicyHandle.layers``).
    """
    root = unwrap_model(model)
    rec = _Recorder(_weight_owners(root))
    handles = _hooks(root, rec)
    _ACTIVE.append(rec)
    try:
        # Compiled graphs would hide the ops from the dispatch mode: audit runs eagerly.
        with torch.compiler.set_stance("force_eager"), rec, _SdpaAsOneOp(rec):
            result = run()
    finally:
        _ACTIVE.remove(rec)
        for h in handles:
            h.remove()
    report = build_report(root, layers, policy, rec.seen, rec.ran, rec.bypassed)
    if has_fused_paths(root) and torch.backends.mha.get_fastpath_enabled():
        report.errors.append(
            "torch.nn's fused inference paths are on (torch.backends.mha."
            "set_fastpath_enabled(True) after apply_policy?): nn.TransformerEncoderLayer and "
            "nn.MultiheadAttention would compute without calling the modules the policy rules")
    report.result = result
    report.casts = rec.casts
    for w in report.warnings:
        warnings.warn(w, PolicyWarning, stacklevel=2)
    if strict:
        report.raise_for_errors()
    return report


def _bypass_errors(layers: dict[str, Resolved], bypassed: dict[str, set[tuple[str, str]]],
                   ) -> dict[str, str]:
    """leaf -> error, for GEMM leaves computed by another module's code in another precision
    than their own rule's (a fused path, or code reading ``self.proj.weight``)."""
    out = {}
    for leaf, records in bypassed.items():
        r = layers.get(leaf)
        if r is None:
            continue
        for by, op in sorted(records):
            host = layers.get(by)
            if host is not None and host.precision == r.precision:
                continue  # computed elsewhere, but in the leaf's own precision
            how = FUSED_OPS.get(op, f"the code of {repr(by) if by else 'the root module'} (aten.{op})")
            where = host.precision if host else "its caller's precision"
            out[leaf] = (f"layer {leaf!r}: rule {r.rule_label} says {r.precision}, but its "
                         f"forward never ran: {how} computed with its weight directly, in "
                         f"{where}")
            break
    return out


def build_report(root: torch.nn.Module, layers: dict[str, Resolved], policy: Policy,
                 seen: dict[str, Counter[str]], ran: set[str],
                 bypassed: dict[str, set[tuple[str, str]]] | None = None) -> AuditReport:
    """Rows, errors and warnings from what was recorded.

    ``seen``: path -> precisions its GEMMs ran in; ``ran``: paths whose forward ran;
    ``bypassed``: GEMM leaf -> (module, op) that read its weights while it was not running.
    """
    gemm_paths = [normalize_path(p) for p, m in root.named_modules() if is_gemm_leaf(m)]
    paths = list(dict.fromkeys([p for p in layers if p in seen] + gemm_paths))
    skipped = _bypass_errors(layers, bypassed or {})
    rows = []
    for p in paths:
        r = layers[p]
        computed = "bypassed" if p in skipped else _fmt(seen.get(p, Counter()))
        rows.append(AuditRow(p, r.rule_label, r.precision, computed,
                             sum(seen.get(p, Counter()).values())))
    errors = []
    for row in rows:
        if row.layer in skipped:
            errors.append(skipped[row.layer])
            continue
        if row.ok:
            continue
        hint = ""
        if row.expected != "fp32" and "fp32" in row.computed.split(","):
            hint = (" (its code keeps fp32: e.g. autocast(enabled=False), an explicit "
                    ".float(), or an op autocast does not lower)")
        errors.append(f"layer {row.layer!r}: rule {row.rule} says {row.expected}, but its "
                      f"GEMMs computed in {row.computed}{hint}")

    warns = []
    src = policy.source
    for rule, prec in policy.layers.items():
        if prec == "fp32":
            continue  # a fp32 island upcasts its inputs: it acts even on a norm alone
        decided = [p for p, r in layers.items() if r.rule == rule]
        if any(seen.get(p) for p in decided):
            continue
        if not any(p in ran for p in decided):
            warns.append(f"{src}: layers[{rule!r}]: {prec} rule: the module did not run "
                         "in the audited forward")
            continue
        kinds = sorted({type(m).__name__ for p, m in root.named_modules()
                        if normalize_path(p) in decided and normalize_path(p) in ran})
        warns.append(f"{src}: layers[{rule!r}]: {prec} rule covers no autocast-eligible op "
                     f"({', '.join(kinds[:3])}: no matmul/conv runs there; e.g. a norm "
                     "stays fp32 under autocast): it changes nothing")
    return AuditReport(rows, errors, warns)


__all__ = ["AuditError", "AuditReport", "AuditRow", "audit_run", "notify_compute"]
