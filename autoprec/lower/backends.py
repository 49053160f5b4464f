"""GEMM formats — fp8, mxfp8, nvfp4 — behind one call: run a Linear-like leaf in one.

Which layers may run a format, and why not, is the format's own fact
(``autoprec.formats.gemm``); this module only dispatches a forward to the backend that
runs it: fp8 (per-tensor current scaling) in ``fp8.py``, mxfp8 / nvfp4 (block scales
along K) in ``blockscale.py``.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from autoprec.device.capability import (
    FP8_BACKENDS,
    TORCHAO_FP8_RECIPES,
    best_fp8_backend,
    blockscale_capability,
    capability,
)
from autoprec.errors import InputError
from autoprec.formats.gemm import BLOCK_SCALED, gemm_format
from autoprec.lower import blockscale, fp8
from autoprec.lower.nvfp4_train import TRAIN_BACKENDS, nvfp4_train_linear
from autoprec.lower.torchao_fp8 import torchao_installed


def linear(module: torch.nn.Module, x: torch.Tensor, precision: str,
           backend: str = "emulated") -> torch.Tensor:
    """Run the Linear-like ``module`` on ``x`` in GEMM format ``precision``."""
    if precision == "nvfp4" and backend in TRAIN_BACKENDS:  # its training recipe
        return nvfp4_train_linear(module, x, backend)
    if gemm_format(precision).block_scaled:  # a scale per block of K: mxfp8, nvfp4
        return blockscale.blockscaled_linear(module, x, precision, backend)
    return fp8.fp8_linear(module, x, backend)  # per-tensor current scaling


def format_backends(used: Collection[str], fp8_backend: str | None, device: torch.device,
                    training: bool = False) -> tuple[dict[str, str], str | None, str]:
    """The backend each GEMM format runs on for a plan using precisions ``used``.

    fp8: ``fp8_backend`` when given (emulated / torch / te / torchao / torchao-rowwise),
    else the best this device runs (``best_fp8_backend``: te, torch, else emulated; with
    ``training`` (the train form) torchao before torch where its fp8 kernels run);
    mxfp8 / nvfp4: the real block-scaled kernels where they run, else emulation. Returns
    (backend by format, the fp8 backend or None when no layer computes in fp8, why that
    fp8 backend). The torchao backends and te-delayed are training recipes: refused for the
    deploy form;
    a training plan's mxfp8 runs on torchao's MXFP8 training GEMMs where the block-scaled
    kernels run (the ``torch`` backend's mxfp8 backward is emulated), its nvfp4 on NVIDIA's
    NVFP4 training recipe (``train-torch`` where the kernels run, else ``train-emulated``).
    """
    backend: str | None = None
    why = ""
    if "fp8" in used:
        if fp8_backend is not None and fp8_backend not in FP8_BACKENDS:
            raise InputError(f"unknown fp8 backend {fp8_backend!r}; expected one of "
                             f"{', '.join(FP8_BACKENDS)}")
        if (fp8_backend in TORCHAO_FP8_RECIPES or fp8_backend == "te-delayed") \
                and not training:
            raise InputError(f"fp8 backend {fp8_backend!r} is a training recipe: it runs "
                             "the train form; the deploy form's fp8 runs on emulated, torch "
                             "or te")
        if fp8_backend is not None:
            backend, why = fp8_backend, capability("fp8", fp8_backend, device)[1]
        else:
            backend, why = best_fp8_backend(device, training=training)
    out = {"fp8": backend or "emulated"}
    for fmt in BLOCK_SCALED:
        if fmt in used:
            real = blockscale_capability(fmt, "torch", device)[0]
            # training: torchao's MXFP8 GEMMs run the backward in mxfp8 too
            ao = training and fmt == "mxfp8" and real and torchao_installed()
            out[fmt] = "torchao" if ao else "torch" if real else "emulated"
            if training and fmt == "nvfp4":  # NVIDIA's recipe (lower.nvfp4_train)
                out[fmt] = train_backend(fmt, out[fmt])
    return out, backend, why


def train_backend(precision: str, backend: str) -> str:
    """The backend that trains GEMM format ``precision`` where ``backend`` runs its forward:
    nvfp4's forward backends map to its training recipe's (``train-emulated`` /
    ``train-torch``, ``lower.nvfp4_train``); every other backend trains as it is."""
    if precision == "nvfp4" and backend in TRAIN_BACKENDS.values():
        return next(k for k, v in TRAIN_BACKENDS.items() if v == backend)
    return backend


__all__ = ["format_backends", "linear", "train_backend"]
