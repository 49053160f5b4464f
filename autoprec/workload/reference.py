"""The model as given is the reference: its own dtypes, per module.

A model arrives in fp32, in bf16 or fp16 (``from_pretrained(..., torch_dtype=torch.bfloat16)``,
``model.to(torch.bfloat16)``), or mixed: a 16-bit model with some modules kept in fp32
(HF's ``_keep_in_fp32_modules``, e.g. T5's ``wo``). Whatever it is, its own outputs — run
as they are, no autocast — are what every error is measured against, and its own layout
is a plan: the deploy form's ``default: <its dtype>`` plus an fp32 rule on every module
kept in fp32 (``ModelReference.rules``). That plan is exact (it stores every tensor in
the dtype it already has), so its error is 0 and it is always a candidate: a tune of a
bf16 model never writes a plan the cost model prices slower than the bf16 model itself.

What a layer is offered (``offered``): the precisions at or below its own, by storage
width (a bf16 layer: bf16, fp16, the GEMM formats) plus fp32, an *island*: the deploy form stores the layer's
weight upcast to fp32 (bf16 -> fp32 is exact: every bf16 value is an fp32 value) and
casts its inputs up, so the layer computes on the very values the model holds, with fp32
accumulation and an fp32 output. tf32 is above a 16-bit layer and not offered (it would be
an upcast that still rounds). A model with fp32 weights offers everything, as before.

Training stays fp32-master only (``autoprec.training.train.check_fp32_masters``; ``tune
--train-aware`` and ``--form train`` refuse a 16-bit model up front): autocast and the
GradScaler assume fp32 weights, and a 16-bit weight updated in place loses small steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.formats.precisions import BYTES, rank

#: Floating parameter dtypes a model may arrive in, and the precision each one is.
DTYPE_PRECISION: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16",
                                           torch.float16: "fp16"}


def _own_params(module: torch.nn.Module, recurse: bool) -> list[torch.Tensor]:
    return [p for p in module.parameters(recurse=recurse) if p.is_floating_point()]


def own_precision(module: torch.nn.Module) -> str:
    """The precision a module's weights are stored in: its own floating parameters' dtype
    (the widest when they differ), else its children's (an attention module's projections),
    else fp32 (a module without weights computes in whatever it is fed)."""
    params = _own_params(module, recurse=False) or _own_params(module, recurse=True)
    precs = [DTYPE_PRECISION.get(p.dtype, "fp32") for p in params]
    return min(precs, key=rank) if precs else "fp32"


def offered(own: str, precisions: Any) -> list[str]:
    """The precisions of ``precisions`` a layer stored in ``own`` may take: those stored in
    no more bytes than ``own`` (for a 16-bit layer: both 16-bit formats — each is lossy
    against the other, bf16 in mantissa, fp16 in range, and the probes measure which —
    and the GEMM formats) and fp32 (an island, module doc)."""
    return [p for p in precisions if p == "fp32" or BYTES[p] <= BYTES[own]]


@dataclass(frozen=True)
class ModelReference:
    """The model as given: the dtype most of its weights are in (``default``) and the
    modules stored in another (``islands``: path -> precision, the topmost such module)."""

    default: str = "fp32"
    islands: dict[str, str] = field(default_factory=dict)
    weight_bytes: int = 0

    @property
    def is_fp32(self) -> bool:
        """An all-fp32 model: every behaviour of autoprec before 16-bit models existed."""
        return self.default == "fp32" and not self.islands

    def label(self) -> str:
        """'bf16', or 'bf16 with 2 modules in fp32', for people."""
        if not self.islands:
            return self.default
        by = sorted(set(self.islands.values()), key=rank)
        n = len(self.islands)
        return (f"{self.default} with {n} module{'s' if n != 1 else ''} in "
                f"{'/'.join(by)}")

    def rules(self) -> dict[str, str]:
        """The model as given as deploy-form rules: ``default`` plus these (exact for a
        uniform 16-bit model: it changes no tensor); ``study.objective.given_policy``."""
        return dict(self.islands)

    def to_dict(self) -> dict[str, Any]:
        """What a policy file records under ``reference:``."""
        out: dict[str, Any] = {"dtype": self.default}
        if self.islands:
            out["layers"] = dict(self.islands)
        return out


def model_reference(model: torch.nn.Module) -> ModelReference:
    """The reference layout of ``model``: the dtype holding most of its weight bytes, and
    the topmost modules whose own weights are stored in another."""
    by_dtype: dict[str, int] = {}
    seen: set[int] = set()
    for p in model.parameters():
        if not p.is_floating_point() or id(p) in seen:
            continue
        seen.add(id(p))
        prec = DTYPE_PRECISION.get(p.dtype, "fp32")
        by_dtype[prec] = by_dtype.get(prec, 0) + p.numel() * p.element_size()
    if not by_dtype:
        return ModelReference()
    default = max(by_dtype, key=lambda k: (by_dtype[k], -rank(k)))
    islands: dict[str, str] = {}
    for path, mod in model.named_modules():
        if not path or any(path.startswith(p + ".") for p in islands):
            continue
        params = _own_params(mod, recurse=True)
        if not params:
            continue
        precs = {DTYPE_PRECISION.get(p.dtype, "fp32") for p in params}
        if len(precs) == 1 and (prec := precs.pop()) != default:
            islands[path] = prec
    return ModelReference(default, islands, sum(by_dtype.values()))


__all__ = ["DTYPE_PRECISION", "ModelReference", "model_reference",
           "offered", "own_precision"]
