"""The GEMM formats — fp8, mxfp8, nvfp4 — as objects: what each is and which layers may run it.

A GEMM format is not an autocast region but a module backend for a Linear-like *leaf*
(DESIGN.md): the leaf quantises its input and weight and runs a low-precision GEMM, taking
and giving its region's dtype. Every stage asks the format object, none re-derives its
facts: the tracer (which leaves may take a format, and why not), policy validation, the
probes, the plan and the cost model (the leaves a format rule reaches), apply (the
backends in ``autoprec.lower.fp8`` / ``autoprec.lower.blockscale``). Modelled on
Transformer Engine's recipe dataclasses (one per format, one support check returning the
reason); the numerics of each format live beside this file (``mx.py``, ``nvfp4.py``).

Alignment (K = in_features, the reduction dim; N = out_features), from ``torch._scaled_mm``
(``_check_scaled_mm_sizes`` in torch 2.13's ``_meta_registrations.py``, as ScaledBlas.cpp):
both dims of the weight operand multiples of 16; block formats also K a multiple of their
block (one scale per block along K), nvfp4 K a multiple of 32 (two fp4 elements a byte, the
packed K / 2 a multiple of 16). Training: nvfp4 has no gradient recipe; mxfp8's input-grad
GEMM reduces over N in blocks of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoprec.formats.mx import MX_BLOCK
from autoprec.formats.nvfp4 import NVFP4_BLOCK
from autoprec.fused import not_called_reason


def linear_dims(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear-like module, else None."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        w = module.weight  # HF GPT-2's Conv1D stores (in, out)
        return int(w.shape[0]), int(w.shape[1])
    return None


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """The (out_features, in_features) weight of a Linear-like module.

    HuggingFace's ``Conv1D`` (GPT-2) stores (in, out) and computes ``x @ W + b``.
    """
    if type(module).__name__ == "Conv1D":
        return module.weight.t()
    return module.weight


@dataclass(frozen=True)
class GemmFormat:
    """One GEMM format: its element and scale types, block, alignment and gradient recipe."""

    name: str
    element: str  # what each value is stored as
    scale: str  # what scales it
    block: int | None  # values per scale along K; None: one scale per tensor
    gradient_recipe: str | None  # how a backward runs; None: forward-only

    def ineligible_reason(self, module: torch.nn.Module, training: bool = False) -> str | None:
        """Why ``module`` cannot run this format (None: it can), prefixed with the name."""
        why = not_called_reason(module)
        if why is not None:
            return f"{self.name}: {why}"
        dims = linear_dims(module)
        if dims is None:
            return f"{self.name}: {type(module).__name__} is not a Linear-like GEMM"
        k, n = dims
        if self.block is None:  # fp8: torch._scaled_mm's 16-multiples
            if k % 16:
                return f"{self.name}: in_features {k} not a multiple of 16"
            if n % 16:
                return f"{self.name}: out_features {n} not a multiple of 16"
            return None
        if k % self.block:
            return (f"{self.name}: in_features {k} not a multiple of the block size "
                    f"{self.block} (one scale per {self.block} elements along K)")
        if self.name == "nvfp4" and k % 32:
            return (f"nvfp4: in_features {k} not a multiple of 32 (fp4 packs two elements "
                    f"per byte; torch._scaled_mm needs the packed K {k // 2} to be a multiple "
                    "of 16)")
        if n % 16:
            return (f"{self.name}: out_features {n} not a multiple of 16 "
                    f"(torch._scaled_mm needs both dims of the weight operand divisible by 16)")
        if training:
            if self.gradient_recipe is None:
                return (f"{self.name}: forward-only in autoprec (no gradient recipe: NVIDIA's "
                        "needs stochastic rounding and Hadamard transforms); train in mxfp8, "
                        "fp8 or a 16-bit precision")
            if n % 32:
                return (f"{self.name}: out_features {n} not a multiple of 32 (training: the "
                        "input gradient GEMM reduces over N in blocks of 32)")
        return None

    def eligible(self, module: torch.nn.Module) -> bool:
        """A leaf that can run this format."""
        return next(iter(module.children()), None) is None and \
            self.ineligible_reason(module) is None


GEMM_FORMAT: dict[str, GemmFormat] = {
    "fp8": GemmFormat(
        "fp8", "e4m3 forward, e5m2 gradients", "fp32 per tensor (current scaling: amax)",
        None, "e5m2 gradients x e4m3 operands, per-tensor current scaling"),
    "mxfp8": GemmFormat(
        "mxfp8", "e4m3", f"e8m0 per {MX_BLOCK} along K (OCP MX, rceil)", MX_BLOCK,
        "MXFP8 (TE MXFP8BlockScaling / torchao MXLinear): E4M3 + E8M0 per 32 along each "
        "backward GEMM's reduction dim, re-quantised from high precision"),
    "nvfp4": GemmFormat(
        "nvfp4", "e2m1", f"e4m3 per {NVFP4_BLOCK} along K x fp32 per tensor", NVFP4_BLOCK,
        None),
}


def gemm_format(precision: str) -> GemmFormat:
    """The format object of ``precision``; ValueError for anything else."""
    fmt = GEMM_FORMAT.get(precision)
    if fmt is None:
        raise ValueError(f"{precision!r} is not a GEMM format ({', '.join(GEMM_FORMAT)})")
    return fmt


def ineligible_reason(module: torch.nn.Module, precision: str,
                      training: bool = False) -> str | None:
    """Why ``module`` cannot run GEMM format ``precision`` (None: it can)."""
    return gemm_format(precision).ineligible_reason(module, training=training)


def eligible(module: torch.nn.Module, precision: str) -> bool:
    """A leaf that can run GEMM format ``precision``."""
    return gemm_format(precision).eligible(module)


__all__ = ["GEMM_FORMAT", "GemmFormat", "eligible", "gemm_format", "ineligible_reason",
           "linear_dims", "linear_weight"]
