"""Prove on a real training step that the fp8 leaves ran fprop, dgrad and wgrad in fp8
through the library (torchao's float8 training), not only that their wrapper was called.

``audit_fp8_training(handle, step)`` runs ``step()`` (a forward that returns the loss) and
its backward under ``lower.torchao_fp8.Float8GemmRecorder``: a dispatch mode that sees
every GEMM whose two operands are torchao fp8 tensors, with their roles (input, weight,
output gradient) and dtypes, and every cast to an fp8 dtype, attributed to the leaf that
ran them. For each leaf the plan runs in fp8 the report holds the three GEMMs and their
operand formats; a leaf missing one, or running other formats than its recipe's, is an
error (``AuditError`` with ``strict``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.apply.apply import PolicyHandle
from autoprec.apply.audit import AuditError
from autoprec.device.capability import TORCHAO_FP8_RECIPES
from autoprec.errors import InputError
from autoprec.formats.gemm import format_of
from autoprec.io.paths import unwrap_model
from autoprec.policy.modules import gemm_leaf_paths

#: The operand formats each recipe's GEMMs read, output gradient first (TE and torchao:
#: e4m3 activations and weights, e5m2 gradients for tensorwise; e4m3 throughout rowwise).
EXPECTED: dict[str, dict[str, tuple[str, str]]] = {
    "tensorwise": {"fprop": ("e4m3", "e4m3"), "dgrad": ("e5m2", "e4m3"),
                   "wgrad": ("e5m2", "e4m3")},
    "rowwise": {"fprop": ("e4m3", "e4m3"), "dgrad": ("e4m3", "e4m3"),
                "wgrad": ("e4m3", "e4m3")},
}


@dataclass
class Fp8TrainingAudit:
    """What each fp8 leaf's GEMMs ran in on one training step, through which library."""

    backend: str | None  # the handle's fp8 backend
    recipe: str | None  # torchao's recipe (None: not a torchao backend)
    leaves: list[str]  # the GEMM leaves the plan runs in fp8
    gemms: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # leaf -> library fp8 GEMMs run
    casts: dict[str, int] = field(default_factory=dict)  # leaf -> casts to an fp8 dtype
    emulated: bool | None = None  # torchao's emulate=True ran (no fp8 kernels here)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def rows(self) -> list[dict[str, Any]]:
        """One row per fp8 leaf: its three GEMMs' operand formats and the library calls."""
        out = []
        for leaf in self.leaves:
            g = self.gemms.get(leaf, {})
            out.append({"layer": leaf, **{k: " x ".join(g[k]) if k in g else "-"
                                          for k in ("fprop", "dgrad", "wgrad")},
                        "gemms": self.calls.get(leaf, 0), "fp8 casts": self.casts.get(leaf, 0)})
        return out

    def table(self) -> str:
        cols = ["layer", "fprop", "dgrad", "wgrad", "gemms", "fp8 casts"]
        rows = [[str(r[c]) for c in cols] for r in self.rows()]
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
                  for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        how = "torchao emulate=True" if self.emulated else "torchao fp8 kernels"
        lines.append(f"backend {self.backend} ({self.recipe}, {how}); "
                     f"{'ok' if self.ok else 'ERRORS: ' + '; '.join(self.errors)}")
        return "\n".join(lines)

    def raise_for_errors(self) -> None:
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise AuditError(self.errors[0] + more)


def audit_fp8_training(handle: PolicyHandle, step: Callable[[], torch.Tensor],
                       strict: bool = True) -> Fp8TrainingAudit:
    """Run ``step()`` and ``backward()`` of the loss it returns; report each fp8 leaf's
    fprop, dgrad and wgrad as torchao ran them (see the module docstring).

    The handle must be active and its fp8 backend a torchao one (InputError otherwise).
    ``strict``: raise AuditError when a leaf misses a GEMM or ran other operand formats.
    Gradients accumulate into ``.grad`` as any backward does (zero them after, if needed).
    """
    from autoprec.lower.torchao_fp8 import Float8GemmRecorder

    if not handle.active:
        raise InputError("audit_fp8_training: this policy handle was removed; apply the "
                         "policy again")
    backend = handle.fp8_backend
    if backend not in TORCHAO_FP8_RECIPES:
        raise InputError(f"audit_fp8_training: the fp8 layers run on backend {backend!r}; "
                         f"the library audit needs one of {', '.join(TORCHAO_FP8_RECIPES)} "
                         "(apply_policy(..., fp8_backend='torchao'))")
    recipe = TORCHAO_FP8_RECIPES[backend]
    root = unwrap_model(handle.model)
    modules = dict(root.named_modules())
    # the per-tensor-scaled GEMM format's leaves (fp8): the ones the fp8 backend runs
    leaves = [p for p in gemm_leaf_paths(root)
              if (f := format_of(handle.layers[p].precision)) is not None and not f.block_scaled]
    report = Fp8TrainingAudit(backend, recipe, leaves)
    with Float8GemmRecorder({modules[p]: p for p in leaves}) as rec:
        loss = step()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError("audit_fp8_training: step() must return the scalar loss, got "
                             f"{type(loss).__name__}")
        loss.backward()
    for g in rec.gemms:
        report.gemms.setdefault(g.leaf, {})[g.gemm] = g.operands
        report.calls[g.leaf] = report.calls.get(g.leaf, 0) + 1
        report.emulated = g.emulated if report.emulated is None else report.emulated or g.emulated
    report.casts = dict(rec.casts)
    for leaf in leaves:
        got = report.gemms.get(leaf, {})
        for gemm, want in EXPECTED[recipe].items():
            if gemm not in got:
                report.errors.append(f"{leaf}: no {gemm} GEMM ran in fp8 through torchao")
            elif got[gemm] != want:
                report.errors.append(f"{leaf}: {gemm} read {' x '.join(got[gemm])}, the "
                                     f"{recipe} recipe reads {' x '.join(want)}")
    stray = sorted(set(report.gemms) - set(leaves))
    if stray:
        report.errors.append(f"fp8 GEMMs ran outside the plan's fp8 leaves: {', '.join(stray)}")
    if strict:
        report.raise_for_errors()
    return report


__all__ = ["EXPECTED", "Fp8TrainingAudit", "audit_fp8_training"]
