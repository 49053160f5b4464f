"""``check``: the pre-deployment gate. Does this policy still hold for this model?

Re-evaluates the policy on the model's eval data and fails (``CheckResult.passed`` False;
the CLI exits 1 with the reasons) when:

- the error (relative L2 of the outputs) or the metric drop exceeds the budget — the
  policy's recorded budget unless one is given; a non-finite output names the first layer
  that produced it;
- the model's structure changed since tuning (its fingerprint differs from the policy's):
  unlike ``eval``, which refuses a mismatch with exit 2, ``check`` loads the policy anyway
  to evaluate it and reports the change as a failed gate (``force`` accepts the change);
- the target device cannot run a precision the policy uses (``Target.supports``);
- the audit finds a GEMM that did not compute in its rule's precision;
- a headroom gate is given (``min_headroom``) and a 16-bit / GEMM-format layer's largest
  value on calibration data comes closer to its format's limit than that factor
  (``evaluation.headroom``);
- the policy file itself says ``feasible: false`` (tune wrote the closest candidate when
  nothing met its budget or its speed target ``--min-speedup``): such a file never passes;
  the reason says which of the two tune missed.

Bad input (model.py, a policy that does not validate, both budgets) stays InputError (2).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import CheckFailed, InputError, PolicyError
from autoprec.evaluation.assess import Assessment, assess
from autoprec.evaluation.json_fields import (
    Reason,
    audit_reasons,
    batch_size_from,
    feasible,
    number,
    reasons_json,
    speedup,
)
from autoprec.formats.precisions import FORMATS, PRECISIONS
from autoprec.fused import fused_paths_off
from autoprec.io.validate import DEFAULT_MAX_ERROR, check_batch_size
from autoprec.policy import Policy, gemm_leaf_paths, load_policy
from autoprec.pricing.target import Target, resolve_target
from autoprec.trace.graph import fingerprint
from autoprec.workload.checkpoint_spec import load_model
from autoprec.workload.loading import ModelSpec
from autoprec.workload.metrics import iter_floats


@dataclass
class CheckResult:
    """The gate's verdict, the figures behind it, and one row per GEMM layer."""

    model: str
    policy: str
    passed: bool
    reasons: list[str]  # why it failed (Reason: .layer names the layer); empty: passed
    budget_kind: str  # "max_error" or "max_drop"
    budget: float
    budget_source: str  # "policy", "argument" or "default"
    error: float | None  # relative L2 of the outputs on eval data (None: not evaluated)
    metric: float | None = None
    fp32_metric: float | None = None
    metric_drop: float | None = None
    nonfinite: int = 0
    feasible: bool = False  # within budget, runnable on the target, audit clean
    est_speedup: float | None = None  # over all-fp32 on the target; None: cannot run there
    target: str = ""  # the resolved target's name (``Target.name``)
    batch_size: int | None = None
    batch_size_from: str = "calibration batch"  # "--batch-size" | "policy" | this
    mode: str = "eager"  # deployment mode priced: eager / compile (torch.compile)
    fingerprint_match: bool | None = None  # None: the policy has no fingerprint
    notes: list[str] = field(default_factory=list)  # warnings that did not fail the gate
    layers: list[dict[str, Any]] = field(default_factory=list)
    eval_batches: int = 0
    breakdown: dict[str, Any] = field(default_factory=dict)  # where the forward's time goes
    form: str = "train"  # how the plan ran (precisions.FORMS)
    weight_bytes: int | None = None  # the weights the applied plan holds on the device
    min_headroom: float | None = None  # the gate's headroom factor (None: not gated)
    headroom: list[dict[str, Any]] = field(default_factory=list)  # evaluation.headroom rows

    @property
    def value(self) -> float | None:
        """The number the budget binds (error or metric drop)."""
        return self.metric_drop if self.budget_kind == "max_drop" else self.error

    def raise_if_failed(self) -> None:
        """Raise CheckFailed (exit 1) naming the first reason, when the gate failed."""
        if not self.passed:
            more = f" (and {len(self.reasons) - 1} more)" if len(self.reasons) > 1 else ""
            raise CheckFailed(f"check failed: {self.reasons[0]}{more}")

    def to_dict(self) -> dict[str, Any]:
        """The ``check --json`` object: the summary at the top level, then the layers.

        ``reasons``, ``feasible`` and ``est_speedup`` mean what they mean in ``eval --json``
        (autoprec.evaluation.json_fields): reasons are ``{"layer", "reason"}`` objects.
        """
        out: dict[str, Any] = {}
        if self.budget_kind == "max_drop":
            out.update(metric_drop=number(self.metric_drop), metric=number(self.metric),
                       fp32_metric=number(self.fp32_metric), output_error=number(self.error))
        else:
            out["error"] = number(self.error)
        out.update(
            budget=self.budget, budget_kind=self.budget_kind, budget_source=self.budget_source,
            est_speedup=number(self.est_speedup), feasible=self.feasible, target=self.target,
            batch_size=self.batch_size, batch_size_from=self.batch_size_from, mode=self.mode,
            form=self.form, weight_bytes=self.weight_bytes, passed=self.passed,
            reasons=reasons_json(self.reasons), notes=list(self.notes),
            fingerprint_match=self.fingerprint_match, nonfinite=self.nonfinite,
            eval_batches=self.eval_batches, model=self.model, policy=self.policy,
            breakdown=dict(self.breakdown), min_headroom=self.min_headroom,
            headroom=[{k: number(v) for k, v in row.items()} for row in self.headroom],
            layers=[{k: number(v) for k, v in row.items()} for row in self.layers],
        )
        return out


def _short(fp: str) -> str:
    return fp[:19] + "…" if len(fp) > 20 else fp


def _budget(policy: Policy, spec: ModelSpec, max_error: float | None,
            max_drop: float | None) -> tuple[str, float, str]:
    """(kind, value, source): an argument wins, then the policy's recorded budget."""
    if max_error is not None and max_drop is not None:
        raise InputError("give --max-error or --max-drop, not both")
    if max_error is not None or max_drop is not None:
        kind, value, source = (("max_drop", max_drop, "argument") if max_drop is not None
                               else ("max_error", max_error, "argument"))
    else:
        drop = ("metric_drop" in policy.metrics or "calibration_metric_drop" in policy.metrics)
        kind = "max_drop" if drop else "max_error"  # an export writes calibration_* only
        value = policy.metrics.get("budget")
        source = "policy"
        if value is None:
            kind, value, source = "max_error", DEFAULT_MAX_ERROR, "default"
    flag = "--" + kind.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        where = f"{policy.source}: metrics.budget" if source == "policy" else flag
        raise InputError(f"{where}: the budget must be a finite number >= 0, got {value!r}")
    if kind == "max_drop" and spec.metric is None:
        why = "the policy's budget is a metric drop" if source == "policy" else flag
        raise InputError(f"{spec.where}: {why} needs a metric(outputs, batch) in model.py")
    return kind, float(value), source


def _marked_infeasible(policy: Policy) -> str | None:
    """Why a policy whose file says ``feasible: false`` fails (None: it does not say so)."""
    if policy.metrics.get("feasible") is not False:
        return None
    kind = "metric_drop" if "metric_drop" in policy.metrics else "error"
    value, budget = policy.metrics.get(kind), policy.metrics.get("budget")
    name = kind.replace("_", " ")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool)
                  for x in (value, budget))
    if numbers and value <= budget:
        return (f"the policy file says feasible: false: tune missed its speed target "
                f"(--min-speedup; est. speed-up {policy.metrics.get('est_speedup', '?')}x) "
                f"although its {name} {value:.4g} was within budget {budget:g}; re-tune "
                "with a reachable --min-speedup")
    over = f" ({name} {value:.4g} > budget {budget:g})" if numbers else ""
    return (f"the policy file says feasible: false: when tuned it was over its budget"
            f"{over}, the closest candidate tune found; re-tune with a larger budget or "
            "more trials")


def _max_abs(model: torch.nn.Module, path: str, spec: ModelSpec, batch: Any) -> float:
    """max |output| of module ``path`` on ``batch`` (the model as it is now)."""
    seen = [0.0]

    def fn(mod: torch.nn.Module, args: Any, out: Any) -> None:
        for t in iter_floats(out):
            seen[0] = max(seen[0], float(t.detach().abs().max())) if t.numel() else seen[0]

    h = model.get_submodule(path).register_forward_hook(fn)
    try:
        with torch.no_grad(), fused_paths_off():
            spec.run(model, batch)
    finally:
        h.remove()
    return seen[0]


def _device_reasons(policy: Policy, a: Assessment, model: torch.nn.Module,
                    resolved: Target) -> tuple[list[str], dict[str, str]]:
    """Why the target cannot run the policy (one reason per precision), per-layer reasons:
    the GEMM leaves' precisions as the applied plan resolved them (``a.layers``)."""
    used: dict[str, list[str]] = {}
    for path in gemm_leaf_paths(model):
        used.setdefault(a.layers[path].precision, []).append(path)
    reasons, layer_why, target = [], {}, resolved.name
    ok, why = resolved.supports(policy.default)
    if not ok:
        reasons.append(f"target {target} cannot run the default region {policy.default}: {why}")
    for prec in PRECISIONS:
        if prec not in used:
            continue
        ok, why = resolved.supports(prec)
        if ok:
            continue
        paths = used[prec]
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        reasons.append(Reason(f"target {target} cannot run {prec} (layer {paths[0]!r}{more}): "
                              f"{why}", paths[0]))
        layer_why.update(dict.fromkeys(paths, why))
    return reasons, layer_why


def _layer_rows(a: Assessment, net: torch.nn.Module, policy: Policy,
                layer_why: dict[str, str]) -> dict[str, dict[str, Any]]:
    """One row per GEMM layer of the traced graph, with its price under the policy."""
    times = a.breakdown.by_module
    rows = {}
    for node in a.graph.gemm_nodes:
        r = a.layers[node.path]  # a shared module: its rule under any of its paths
        t = times.get(node.path)
        rows[node.path] = {
            "layer": node.path, "kind": node.kind, "precision": r.precision,
            "rule": r.rule_label, "computed": None,  # filled in by the audit
            "supported": node.path not in layer_why,
            "est_time_us": None if t is None else t * 1e6,
            "reason": layer_why.get(node.path) or policy.reasons.get(node.path),
        }
    return rows


def check(
    model: str | Path | ModelSpec,
    policy_path: str | Path | Policy,
    max_error: float | None = None,
    max_drop: float | None = None,
    force: bool = False,
    target: str | None = None,
    batch_size: int | None = None,
    fp8_backend: str | None = None,
    compile: bool | None = None,
    min_headroom: float | None = None,
) -> CheckResult:
    """Gate ``policy_path`` on ``model`` (a model.py or a ModelSpec); see the module docs.

    Returns the verdict (``passed``) rather than raising, so a caller gets the figures
    either way (``raise_if_failed`` for exit-1 semantics). ``target`` / ``batch_size``
    default to the policy's, then h100 / the calibration batch's (as tune). ``force``
    accepts a changed fingerprint (noted, not failed). ``compile``: price the plan as
    ``torch.compile`` runs it (True), op by op (False); default: the policy's target.mode.
    ``fp8_backend``: as ``apply_policy``'s (the fp8 layers' backend; mxfp8 / nvfp4 run the
    block-scaled kernels where they can, else emulation). ``min_headroom``: fail a layer
    whose calibration max |x|, |y| is within that factor of its format's limit. Raises
    InputError/PolicyError (exit 2) for bad input.
    """
    check_batch_size(batch_size)
    if min_headroom is not None and not (isinstance(min_headroom, (int, float))
                                         and math.isfinite(min_headroom) and min_headroom > 0):
        raise InputError(f"--min-headroom must be a finite number > 0, got {min_headroom!r}")
    policy = policy_path if isinstance(policy_path, Policy) else load_policy(policy_path)
    # a checkpoint folder under a training plan is held in fp32 (the trainer's masters)
    spec = (model if isinstance(model, ModelSpec)
            else load_model(model, masters=policy.form == "train"))
    kind, budget, source = _budget(policy, spec, max_error, max_drop)
    # the target resolved once (name, mode, form, fp8 backend, batch, speed source), as eval and
    # tune resolve it; check measures nothing: a local target's calibration is read where
    # it is cached
    resolved = resolve_target(target, policy, compile=compile, fp8_backend=fp8_backend,
                              batch_size=batch_size, measure=False,
                              policy_path=policy_path if isinstance(policy_path, (str, Path))
                              else None)
    tgt, speed = resolved.name, resolved.speed
    net = spec.model()
    calib = spec.calibration_batches()
    bs = resolved.deploy_batch(calib[0])
    result = CheckResult(model=spec.where, policy=policy.source, passed=False, reasons=[],
                         budget_kind=kind, budget=budget, budget_source=source, error=None,
                         target=tgt, batch_size=bs,
                         batch_size_from=batch_size_from(batch_size, policy.batch_size),
                         mode=resolved.mode)
    reasons, notes = result.reasons, result.notes

    # -- structure --------------------------------------------------------------------
    actual = fingerprint(net)
    if policy.fingerprint is None:
        notes.append(f"{policy.source}: no model.fingerprint: the model's structure is not "
                     "checked (normal for a hand-written policy)")
    else:
        result.fingerprint_match = policy.fingerprint == actual
        if not result.fingerprint_match:
            msg = (f"model changed: its fingerprint {_short(actual)} differs from the "
                   f"policy's {_short(policy.fingerprint)} (module paths, types or parameter "
                   f"shapes changed since tuning); re-tune the policy")
            (notes if force else reasons).append(msg + ("; accepted (--force)" if force else ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fingerprint is reported above
        try:
            policy.validate(net, force=True)
        except PolicyError as err:
            if result.fingerprint_match is False:
                reasons.append(f"the policy no longer fits the changed model: {err}")
                return result
            raise

    # -- score, audit and price: the pipeline eval shares (evaluation/assess.py) ---
    a = assess(spec, net, policy, target=resolved, force=True,
               capture_warnings=True)
    if speed.local:
        notes.append(f"speed: {speed.note}")

    # -- target device: the applied plan's precisions -----------------------------------
    if not resolved.named:
        notes.append(f"no target given or in the policy: checked for {tgt} (the default)")
    dev_reasons, layer_why = _device_reasons(policy, a, net, resolved)
    reasons.extend(dev_reasons)
    s, ref, report, bd = a.score, a.reference, a.audit, a.breakdown
    result.eval_batches = a.eval_batches
    result.est_speedup = a.est_speedup
    result.form = resolved.form  # the policy's: how its plan ran
    result.weight_bytes = a.cost.weight_bytes(policy)
    result.breakdown = {**bd.to_dict(), "audited_casts": report.casts}
    notes.extend(n for n in a.notes if "fingerprint" not in n)
    rows = _layer_rows(a, net, policy, layer_why)
    for row in report.rows:
        if row.layer in rows:
            rows[row.layer]["computed"] = row.computed
    reasons.extend(audit_reasons(report))
    if a.casts_note():  # priced from the calibration batch's trace
        notes.append(a.casts_note())
    rooms = {h.layer: h for h in a.headroom}
    for path, row in rows.items():
        h = rooms.get(path)
        row["headroom"] = None if h is None or not math.isfinite(h.headroom) else h.headroom
    result.layers = list(rows.values())
    result.headroom = [h.to_dict() for h in a.headroom]
    result.min_headroom = min_headroom
    if min_headroom is not None:
        for h in a.headroom:
            if h.headroom < min_headroom:
                reasons.append(Reason(f"headroom {h.headroom:.3g}x < {min_headroom:g} "
                                      f"(--min-headroom) at layer {h.layer!r} ({h.precision}): "
                                      f"max |x|, |y| {h.max_abs:.3g} of {h.carrier}'s "
                                      f"{h.limit:g} on calibration data", h.layer))
    result.error, result.nonfinite = s.error, s.nonfinite
    result.metric, result.metric_drop = s.metric, s.metric_drop
    result.fp32_metric = ref.metric
    value = s.value if kind == "max_drop" else s.error

    name = "metric drop" if kind == "max_drop" else "error"
    if s.nonfinite:
        where, bad_layer = "", None
        if a.first_nonfinite is not None:  # the policy is removed: _max_abs measures fp32
            path, i = a.first_nonfinite
            bad_layer = path
            r = a.layers.get(path)
            prec = r.precision if r is not None else "?"
            fmt = FORMATS.get(prec)
            peak = _max_abs(net, path, spec, spec.eval_batches()[i])
            limit = f" > {fmt.max:g}, the {prec} maximum" if fmt and peak > fmt.max else ""
            where = (f"; first at layer {path!r} ({prec}) on eval batch {i}: its fp32 output "
                     f"reaches max|y| {peak:.3g}{limit}")
        reasons.append(Reason(f"{name} inf: {s.nonfinite} non-finite output values under the "
                              f"policy{where}", bad_layer))
    elif not value <= budget:  # also catches nan
        reasons.append(f"{name} {value:.4g} > budget {budget:g} ({source}) on eval data "
                       f"({a.eval_batches} batches)")
    marked = _marked_infeasible(policy)
    if marked:
        reasons.append(marked)
    result.feasible = bool(feasible(value, budget, runnable=not layer_why,
                                    audit_ok=not report.errors))
    result.est_speedup = speedup(result.est_speedup, runnable=not layer_why)
    result.passed = not reasons
    return result


__all__ = ["CheckResult", "check"]
