"""The GEMM formats — fp8, mxfp8, nvfp4 — as objects: what each is and which layers may run it.

A GEMM format is not an autocast region but a module backend for a Linear-like *leaf*
(docs/overview.md): the leaf quantises its input and weight and runs a low-precision GEMM, taking
and giving its region's dtype. Every stage asks the format object, none re-derives its
facts: the tracer (which leaves may take a format, and why not), policy validation, the
probes (how gradients flow in it), the plan and the cost model (the leaves a format rule
reaches, the bytes it stores and the quantisation passes it runs), apply (the backends in
``autoprec.lower.fp8`` / ``autoprec.lower.blockscale``). Modelled on Transformer Engine's
recipe dataclasses (one per format, one support check returning the reason); the numerics of
each format live beside this file (``fp8.py``, ``mx.py``, ``nvfp4.py``).

Alignment (K = in_features, the reduction dim; N = out_features), from ``torch._scaled_mm``
(``_check_scaled_mm_sizes`` in torch 2.13's ``_meta_registrations.py``, as ScaledBlas.cpp):
both dims of the weight operand multiples of 16; block formats also K a multiple of their
block (one scale per block along K), nvfp4 K a multiple of 32 (two fp4 elements a byte, the
packed K / 2 a multiple of 16). Training: the input-gradient GEMM reduces over N, in blocks
of 32 (mxfp8) or of 16 packed two a byte (nvfp4): N a multiple of 32 either way.

"Linear-like" is decided here once (:func:`linear_dims`, :func:`is_linear_like`): an
``nn.Linear`` or HuggingFace's ``Conv1D`` (GPT-2), which stores its weight (in, out)
(:func:`stores_in_out`). :func:`is_gemm_module` is the wider "its own forward is one
GEMM/conv" (adds ``nn.Bilinear`` and the convolutions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autoprec.formats.elements import NumericFormat
from autoprec.formats.fp8 import E5M2, fake_quant_fp8
from autoprec.formats.mx import MX_BLOCK, fake_quant_mxfp8_padded
from autoprec.formats.nvfp4 import NVFP4_BLOCK
from autoprec.formats.nvfp4_train import fake_quant_nvfp4_padded
from autoprec.fused import not_called_reason

#: Modules whose own forward is one GEMM/conv of their weight (besides the Linear-likes).
_GEMM_MODULE_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Linear, torch.nn.Bilinear, torch.nn.modules.conv._ConvNd,
)


def stores_in_out(module: torch.nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2): a Linear storing its weight (in, out), computing
    ``x @ W + b``. Known by class name, so its library need not be imported."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def linear_dims(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear-like module, else None."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if stores_in_out(module):
        w = module.weight  # (in, out)
        return int(w.shape[0]), int(w.shape[1])
    return None


def is_linear_like(module: torch.nn.Module) -> bool:
    """``nn.Linear`` or HF ``Conv1D``: a module a GEMM format's backend can run."""
    return linear_dims(module) is not None


def is_gemm_module(module: torch.nn.Module) -> bool:
    """A module whose own forward is one GEMM/conv of its weight: the Linear-likes,
    ``nn.Bilinear`` and the convolutions."""
    return isinstance(module, _GEMM_MODULE_TYPES) or stores_in_out(module)


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """The (out_features, in_features) weight of a Linear-like module."""
    if stores_in_out(module):
        return module.weight.t()
    return module.weight


@dataclass(frozen=True)
class GemmFormat:
    """One GEMM format: its element and scale types, block, alignment, gradient recipe,
    stored bytes and the quantisation passes its activation input costs."""

    name: str
    element: str  # what each value is stored as
    scale: str  # what scales it
    block: int | None  # values per scale along K; None: one scale per tensor
    gradient_recipe: str | None  # how a backward runs; None: forward-only
    #: Bytes per element as stored and moved, its scales included: fp8 1 (one fp32 scale per
    #: tensor: nothing per element); mxfp8 1 + 1/32 (an E8M0 byte per 32); nvfp4 1/2 + 1/16
    #: (two E2M1 a byte, an E4M3 byte per 16; the per-tensor fp32 scale is nothing per element).
    bytes_per_element: float
    #: Per-tensor amax passes over an activation before its quantise pass (Transformer
    #: Engine's Float8CurrentScaling: one; mxfp8: none, a 32-block is one row's; nvfp4: one,
    #: for its per-tensor fp32 scale; benchmarks/results/b200_profile.yaml).
    amax_passes: int
    #: A separate kernel turns the amax into the scale before the cast (fp8's current scaling).
    scale_kernel: bool
    #: Range and resolution of the elements (block formats: their scales give fp32's range).
    numeric: NumericFormat
    #: Bits a value carries (sign + exponent + mantissa of the element).
    element_bits: int
    #: (rtol, atol) for comparing one op in this format against a hand-made reference
    #: (``precisions.TOLERANCES``, after Transformer Engine's ``dtype_tols``).
    tolerance: tuple[float, float]
    #: What K must be a multiple of besides the block, and why (nvfp4: two fp4 a byte).
    k_multiple: tuple[int, str] | None = None
    #: What N must be a multiple of to train, and why (mxfp8: the input-gradient GEMM).
    train_n_multiple: tuple[int, str] | None = None
    #: torch dtypes the emulation needs, and the ``ScalingType`` of a real block-scaled
    #: ``torch.nn.functional.scaled_mm`` (None: not a block format) and its extra dtypes.
    emulation_dtypes: tuple[str, ...] = ("float8_e4m3fn",)
    scaled_mm_recipe: str | None = None
    kernel_dtypes: tuple[str, ...] = ()
    #: Backends that run this format's gradient recipe besides ``emulated`` / ``torch``
    #: (mxfp8: torchao's MXFP8 training GEMMs; nvfp4: NVIDIA's recipe, ``lower.nvfp4_train``).
    train_backends: tuple[str, ...] = ()

    # -- what it is --------------------------------------------------------------------------
    @property
    def forward_only(self) -> bool:
        """No gradient recipe: layers in it cannot train (and no gradient probes run)."""
        return self.gradient_recipe is None

    @property
    def block_scaled(self) -> bool:
        """A scale per block of K: nothing overflows, a per-tensor underflow says little."""
        return self.block is not None

    @property
    def per_tensor_scaled(self) -> bool:
        """One scale per tensor from its amax (current scaling): the cast's floor moves with
        the tensor's amax."""
        return self.block is None

    @property
    def aligned_dims(self) -> str:
        """The alignment rule in a few words (for "no eligible Linear inside" reasons)."""
        return "both dims multiples of 16" if self.block is None else "block-aligned dims"

    # -- which layers ------------------------------------------------------------------------
    def shape_problems(self, k: int, n: int, training: bool = False) -> list[str]:
        """What breaks the alignment rules for a (K=in, N=out) GEMM (empty: none)."""
        out: list[str] = []
        if self.block is None:  # torch._scaled_mm's 16-multiples
            if k % 16:
                out.append(f"in_features {k} not a multiple of 16")
            if n % 16:
                out.append(f"out_features {n} not a multiple of 16")
            return out
        if k % self.block:
            out.append(f"in_features {k} not a multiple of the block size {self.block} "
                       f"(one scale per {self.block} elements along K)")
        elif self.k_multiple is not None and k % self.k_multiple[0]:
            out.append(f"in_features {k} not a multiple of {self.k_multiple[0]} "
                       f"({self.k_multiple[1].format(k_half=k // 2)})")
        if n % 16:
            out.append(f"out_features {n} not a multiple of 16 (torch._scaled_mm needs both "
                       "dims of the weight operand divisible by 16)")
        if training and not out:
            if self.forward_only:
                out.append("forward-only in autoprec (no gradient recipe); train in a "
                           "format with one or a 16-bit precision")
            elif self.train_n_multiple is not None and n % self.train_n_multiple[0]:
                out.append(f"out_features {n} not a multiple of {self.train_n_multiple[0]} "
                           f"({self.train_n_multiple[1]})")
        return out

    def ineligible_reason(self, module: torch.nn.Module, training: bool = False) -> str | None:
        """Why ``module`` cannot run this format (None: it can), prefixed with the name."""
        why = not_called_reason(module)
        if why is not None:
            return f"{self.name}: {why}"
        dims = linear_dims(module)
        if dims is None:
            return f"{self.name}: {type(module).__name__} is not a Linear-like GEMM"
        problems = self.shape_problems(*dims, training=training)
        return f"{self.name}: {problems[0]}" if problems else None

    def eligible(self, module: torch.nn.Module) -> bool:
        """A leaf that can run this format."""
        return next(iter(module.children()), None) is None and \
            self.ineligible_reason(module) is None

    # -- gradients ---------------------------------------------------------------------------
    def fake_quant_grad(self, g: torch.Tensor) -> torch.Tensor | None:
        """``g`` (an output gradient) rounded as the format's backward reads it, fp32; None:
        forward-only (no gradient flows in it)."""
        if self.forward_only:
            return None
        if self.block is None:  # e5m2 with per-tensor current scaling
            return fake_quant_fp8(g, E5M2)
        if self.block == NVFP4_BLOCK:  # dY in 1x16 e2m1 blocks, stochastic rounding (fixed
            # seed: a probe's statistic is reproducible)
            gen = torch.Generator(device=g.device).manual_seed(0)
            return fake_quant_nvfp4_padded(g, stochastic=True, generator=gen)
        return fake_quant_mxfp8_padded(g)  # dY in e4m3 blocks of 32 (the MXFP8 recipe)

    # -- what its quantisation costs ---------------------------------------------------------
    # One activation input of n elements, src_bytes each (scalars or numpy arrays alike).
    @property
    def quant_reads(self) -> int:
        """Passes reading the input: the amax passes, then the quantise pass."""
        return self.amax_passes + 1

    def quant_seconds(self, n: Any, src_bytes: Any, bandwidth: float, launch: float) -> Any:
        """Seconds of the quantisation kernels run op by op (eager): each amax pass reads the
        input, the quantise pass reads it and writes ``bytes_per_element``, each a launch."""
        read = n * src_bytes / bandwidth
        tm = self.amax_passes * (read + launch) + read + n * self.bytes_per_element / bandwidth \
            + launch
        return tm + (launch if self.scale_kernel else 0.0)  # amax -> scale

    def quant_bytes(self, n: Any, src_bytes: Any) -> Any:
        """Bytes the quantisation moves when fused (compiled): every read pass, the write."""
        return n * (src_bytes * self.quant_reads + self.bytes_per_element)

    def quant_kernels(self, n: float, src_bytes: float) -> list[tuple[str, float]]:
        """(kernel, bytes moved) of the eager quantisation, in launch order."""
        out = [("amax", n * src_bytes)] * self.amax_passes
        if self.scale_kernel:
            out.append((f"{self.name}_scale", 0.0))
        out.append((f"{self.name}_cast", n * (src_bytes + self.bytes_per_element)))
        return out


#: The GEMM format objects by name (``precisions.GEMM_FORMATS`` are their names, in order).
GEMM_FORMAT_BY_NAME: dict[str, GemmFormat] = {
    "fp8": GemmFormat(
        "fp8", "e4m3 forward, e5m2 gradients", "fp32 per tensor (current scaling: amax)",
        None, "e5m2 gradients x e4m3 operands, per-tensor current scaling",
        bytes_per_element=1.0, amax_passes=1, scale_kernel=True,
        # forward activations/weights (e4m3); gradients e5m2 (precisions.FP8_E5M2)
        numeric=NumericFormat("fp8", 448.0, 2.0**-6, 3), element_bits=8,
        tolerance=(1.25e-1, 2e-2)),
    "mxfp8": GemmFormat(
        "mxfp8", "e4m3", f"e8m0 per {MX_BLOCK} along K (OCP MX, rceil)", MX_BLOCK,
        "MXFP8 (TE MXFP8BlockScaling / torchao MXLinear): E4M3 + E8M0 per 32 along each "
        "backward GEMM's reduction dim, re-quantised from high precision",
        bytes_per_element=1 + 1 / MX_BLOCK, amax_passes=0, scale_kernel=False,
        numeric=NumericFormat("mxfp8", 448.0, 2.0**-6, 3), element_bits=8,  # e4m3 elements
        tolerance=(1.25e-1, 2e-2),
        train_n_multiple=(32, "training: the input gradient GEMM reduces over N in blocks "
                              "of 32"),
        emulation_dtypes=("float8_e4m3fn", "float8_e8m0fnu"), scaled_mm_recipe="BlockWise1x32",
        train_backends=("torchao",)),
    "nvfp4": GemmFormat(
        "nvfp4", "e2m1", f"e4m3 per {NVFP4_BLOCK} along K x fp32 per tensor", NVFP4_BLOCK,
        "NVIDIA's NVFP4 recipe (TE NVFP4BlockScaling): X and dY in 1x16 blocks along each "
        "GEMM's reduction dim, W in 16x16 tiles, stochastic rounding of dY, a random "
        "Hadamard transform on the wgrad operands",
        bytes_per_element=0.5 + 1 / NVFP4_BLOCK, amax_passes=1, scale_kernel=False,
        numeric=NumericFormat("nvfp4", 6.0, 1.0, 1), element_bits=4,  # e2m1 elements
        tolerance=(5e-1, 1e-1),
        k_multiple=(32, "fp4 packs two elements per byte; torch._scaled_mm needs the packed K "
                        "{k_half} to be a multiple of 16"),
        train_n_multiple=(32, "training: the input gradient GEMM reduces over N in blocks "
                              "of 16, packed two fp4 a byte"),
        scaled_mm_recipe="BlockWise1x16", kernel_dtypes=("float4_e2m1fn_x2",),
        train_backends=("train-emulated", "train-torch")),
}
#: The block-scaled formats' names (a scale per block of K).
BLOCK_SCALED: tuple[str, ...] = tuple(n for n, f in GEMM_FORMAT_BY_NAME.items() if f.block_scaled)


def gemm_format(precision: str) -> GemmFormat:
    """The format object of ``precision``; ValueError for anything else."""
    fmt = GEMM_FORMAT_BY_NAME.get(precision)
    if fmt is None:
        raise ValueError(f"{precision!r} is not a GEMM format ({', '.join(GEMM_FORMAT_BY_NAME)})")
    return fmt


def format_of(precision: str) -> GemmFormat | None:
    """The format object of ``precision``, None for a region (fp32 / tf32 / bf16 / fp16)."""
    return GEMM_FORMAT_BY_NAME.get(precision)


def is_forward_only(precision: str) -> bool:
    """A GEMM format with no gradient recipe: no layer trains in it (none today; every
    format autoprec has trains)."""
    fmt = format_of(precision)
    return fmt is not None and fmt.forward_only


def is_block_scaled(precision: str) -> bool:
    """A GEMM format with a scale per block of K (mxfp8, nvfp4)."""
    fmt = format_of(precision)
    return fmt is not None and fmt.block_scaled


def ineligible_reason(module: torch.nn.Module, precision: str,
                      training: bool = False) -> str | None:
    """Why ``module`` cannot run GEMM format ``precision`` (None: it can)."""
    return gemm_format(precision).ineligible_reason(module, training=training)


def eligible(module: torch.nn.Module, precision: str) -> bool:
    """A leaf that can run GEMM format ``precision``."""
    return gemm_format(precision).eligible(module)


__all__ = ["BLOCK_SCALED", "GEMM_FORMAT_BY_NAME", "GemmFormat", "eligible",
           "format_of", "gemm_format", "ineligible_reason", "is_block_scaled",
           "is_forward_only", "is_gemm_module",
           "is_linear_like", "linear_dims", "linear_weight", "stores_in_out"]
