"""Audit an applied training-form policy on a real training step: the forward *and* the
backward of every GEMM leaf ran in its rule's precision.

The forward audit (``apply.audit``) sees the forward only; a training step's backward is
where a rule can silently not hold (a gradient upcast, an fp8 leaf whose backward never
quantised its gradient). ``audit_step(model, policy, step)`` applies the policy, runs
``step()`` (forward, loss, ``backward()``; optionally the optimizer) and:

- audits the forward as ``apply.audit`` does (its rows and errors);
- for every GEMM leaf, records the GEMMs that run between its full-backward pre-hook (its
  output's gradient is ready) and the next leaf's — its dgrad and wgrad — with their
  operands' dtypes (a ``TorchDispatchMode``, after autocast);
- checks them against the rule: a bf16 / fp16 leaf's gradient GEMMs read 16-bit operands;
  an fp32 leaf's, and a tf32 leaf's (apply enables tf32 inside the forward's ``with`` block
  only: its backward runs fp32), read fp32; an fp8 leaf's backward quantises its gradient to
  e5m2 (as TE and torchao do, and autoprec's own backends before their GEMMs).

A leaf whose backward ran another precision is an error naming the layer; a leaf whose
backward did not run (its output not in the loss) is a row with ``computed`` "-".
Functional matmuls of a parent module's own code that run inside a leaf's window are
attributed to that leaf (models with fused attention have none).
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoprec.apply.audit import _GEMM_OPS, AuditReport, AuditRow, gemm_precision
from autoprec.io.paths import unwrap_model
from autoprec.policy.modules import is_gemm_leaf
from autoprec.policy.schema import Policy

#: aten ops of a backward that are GEMMs (conv's backward is one op computing both grads).
_BACKWARD_GEMMS = _GEMM_OPS | {"convolution_backward", "mkldnn_convolution_backward"}
_E5M2 = getattr(torch, "float8_e5m2", None)


def expected_backward(precision: str) -> str:
    """What a leaf ruled ``precision`` computes its gradient GEMMs in (fp8: its gradient
    quantised to e5m2, "e5m2")."""
    if precision in ("fp32", "tf32"):
        return "fp32"
    if precision in ("bf16", "fp16"):
        return precision
    return "e5m2"


class _Backward(TorchDispatchMode):
    """Gradient GEMMs per leaf (the leaf whose backward window is open)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.seen: dict[str, Counter[str]] = defaultdict(Counter)
        self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.backward or self.current is None:
            return out
        name = func.overloadpacket.__name__
        tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                   if isinstance(t, torch.Tensor)]
        if _E5M2 is not None and any(t.dtype == _E5M2 for t in tensors):
            self.seen[self.current]["e5m2"] += 1
        if name in _BACKWARD_GEMMS:
            ins = {t.dtype for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.is_floating_point()}
            prec = gemm_precision(ins, name, "cpu" if not tensors else tensors[0].device.type)
            if prec == "tf32":  # the emulation's flag is the forward's; CUDA's is off here
                prec = "fp32"
            if prec is not None:
                self.seen[self.current][prec] += 1
        return out


class TrainingStep:
    """A step split for ``audit_step``: ``forward()`` returns the loss (audited as the
    forward), ``backward(loss)`` runs the backward (audited as the backward)."""

    def __init__(self, model: torch.nn.Module, forward: Callable[[Any, Any], Any],
                 loss: Callable[[Any, Any], torch.Tensor], batch: Any) -> None:
        self.model, self._forward, self._loss, self.batch = model, forward, loss, batch

    def forward(self) -> torch.Tensor:
        return self._loss(self._forward(self.model, self.batch), self.batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def __call__(self) -> None:
        self.backward(self.forward())


def audit_step(model: torch.nn.Module, policy: Policy, step: TrainingStep, *,
               target: str | None = None, fp8_backend: str | None = None,
               force: bool = False) -> tuple[AuditReport, AuditReport]:
    """(the forward's audit, the backward's) of ``policy`` on one real training step of
    ``model``: ``step.forward()`` (the loss) audited as ``apply.audit`` audits a forward,
    then ``step.backward(loss)``. Not strict: each report's ``errors`` name the rules that
    did not run."""
    from autoprec.apply.apply import apply_policy
    from autoprec.apply.audit import audit_run

    rec = _Backward()
    root = unwrap_model(model)
    leaves = {p: m for p, m in root.named_modules() if is_gemm_leaf(m)}
    hooks = []
    for path, mod in leaves.items():
        def pre(_m: Any, _g: Any, p: str = path) -> None:
            rec.current = p  # this leaf's gradient GEMMs run next
        hooks.append(mod.register_full_backward_pre_hook(pre))
    got: dict[str, torch.Tensor] = {}

    def forward() -> torch.Tensor:
        got["loss"] = step.forward()
        return got["loss"]

    try:
        with apply_policy(model, policy, target=target, fp8_backend=fp8_backend,
                          force=force) as handle:
            fwd = audit_run(handle.model, handle.layers, handle.policy, forward, strict=False)
            with rec, warnings.catch_warnings():
                # the first leaf's inputs need no gradient: its pre-hook is what is used
                warnings.filterwarnings("ignore", "Full backward hook is firing")
                rec.backward = True
                step.backward(got["loss"])
            layers = dict(handle.layers)
    finally:
        for h in hooks:
            h.remove()
    rows, errors = [], []
    for path in leaves:
        res = layers.get(path)
        if res is None:
            continue
        want = expected_backward(res.precision)
        seen = rec.seen.get(path, Counter())
        if want == "e5m2":
            computed = "e5m2" if seen["e5m2"] else ",".join(sorted(seen)) or "-"
        else:
            got = {p for p in seen if p != "e5m2"}
            computed = ",".join(sorted(got)) or "-"
        row = AuditRow(path, res.rule_label, want, computed, sum(
            v for k, v in seen.items() if k != "e5m2"))
        rows.append(row)
        if not row.ok:
            errors.append(f"{path}: its rule ({row.rule}: {res.precision}) says its backward "
                          f"computes in {want}, but its gradient GEMMs computed in {computed}")
    return fwd, AuditReport(rows, errors)


__all__ = ["TrainingStep", "audit_step", "expected_backward"]
