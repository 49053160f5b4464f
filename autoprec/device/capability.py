"""Can this device run this precision (with this fp8 backend)? One answer: ``(ok, reason)``.

Used at run time (apply chooses a backend), by ``autoprec env``, and as the skip reason of
GPU tests, so the three always agree.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import torch

from autoprec.formats.gemm import BLOCK_SCALED, format_of, gemm_format
from autoprec.formats.precisions import PRECISIONS, check_precision, is_gemm_format

FP8_BACKENDS = ("emulated", "torch", "te", "te-delayed", "torchao", "torchao-rowwise")
#: The torchao fp8 backends -> torchao float8 training recipe (``lower.torchao_fp8``).
TORCHAO_FP8_RECIPES: dict[str, str] = {"torchao": "tensorwise", "torchao-rowwise": "rowwise"}
#: Lowest CUDA compute capability whose fp8 tensor cores run each torchao recipe's GEMMs
#: (torch._scaled_mm: tensorwise scales on Ada/Hopper, row-wise scales on Hopper and newer).
TORCHAO_MIN_SM: dict[str, tuple[int, int]] = {"tensorwise": (8, 9), "rowwise": (9, 0)}
TORCHAO_HINT = "pip install 'autoprec[train-fp8]' (torchao>=0.18)"


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cuda_sm(dev: torch.device) -> tuple[int, int] | None:
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(dev.index or 0)


def fp8_backend_capability(
    backend: str, device: str | torch.device | None = None
) -> tuple[bool, str]:
    """Whether an fp8 backend runs here: emulated anywhere; torch/TE need CUDA SM >= 8.9;
    torchao wherever it imports (its fp8 kernels on CUDA SM >= 8.9, rowwise 9.0; elsewhere
    its own emulation, said in the reason: ``torchao_fp8_kernels``)."""
    dev = _device(device)
    if backend in TORCHAO_FP8_RECIPES:
        return _torchao_capability(backend, dev)
    if backend == "emulated":
        if not hasattr(torch, "float8_e4m3fn"):
            return False, f"emulated fp8: torch {torch.__version__} has no float8_e4m3fn"
        return True, "emulated fp8: quantise-dequantise through float8_e4m3fn (accuracy only)"
    if backend not in FP8_BACKENDS:
        return False, f"unknown fp8 backend {backend!r}; expected one of {', '.join(FP8_BACKENDS)}"
    if dev.type != "cuda":
        return False, f"{backend} fp8: needs a CUDA device, this is {dev.type}"
    if not torch.cuda.is_available():
        return False, f"{backend} fp8: CUDA is not available"
    sm = _cuda_sm(dev)
    if sm is None or sm < (8, 9):
        return False, f"{backend} fp8: needs CUDA SM >= 8.9 (Ada/Hopper), this is SM {sm}"
    if backend in ("te", "te-delayed") and importlib.util.find_spec("transformer_engine") is None:
        return False, (f"{backend} fp8: transformer_engine is not installed "
                       "(pip install autoprec[fp8])")
    if backend == "torch" and not hasattr(torch, "_scaled_mm"):
        return False, f"torch fp8: torch {torch.__version__} has no _scaled_mm"
    return True, f"{backend} fp8: available on SM {sm[0]}.{sm[1]}"


def torchao_fp8_kernels(backend: str, device: str | torch.device | None = None
                        ) -> tuple[bool, str]:
    """``(ok, reason)``: does torchao backend ``backend`` run its GEMMs as fp8 kernels here
    (not its emulation)? Needs torchao and CUDA SM >= 8.9 (rowwise: 9.0)."""
    dev = _device(device)
    recipe = TORCHAO_FP8_RECIPES[backend]
    if importlib.util.find_spec("torchao") is None:
        return False, f"{backend} fp8: torchao is not installed ({TORCHAO_HINT})"
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False, f"{backend} fp8: its fp8 kernels need a CUDA device, this is {dev.type}"
    sm = torch.cuda.get_device_capability(dev.index or 0)
    need = TORCHAO_MIN_SM[recipe]
    if sm < need:
        return False, (f"{backend} fp8: {recipe} fp8 GEMMs need SM >= {need[0]}.{need[1]}, "
                       f"this is SM {sm[0]}.{sm[1]}")
    return True, (f"{backend} fp8: torchao Float8Linear ({recipe}), torch._scaled_mm for "
                  f"fprop, dgrad and wgrad on SM {sm[0]}.{sm[1]}")


def _torchao_capability(backend: str, dev: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec("torchao") is None:
        return False, f"{backend} fp8: torchao is not installed ({TORCHAO_HINT})"
    ok, why = torchao_fp8_kernels(backend, dev)
    if ok:
        return ok, why
    recipe = TORCHAO_FP8_RECIPES[backend]
    return True, (f"{backend} fp8: torchao Float8Linear ({recipe}) with emulate=True on "
                  f"{dev.type}: the library's quantise-dequantise (accuracy only; {why})")


#: Backends of the block-scaled formats (mxfp8, nvfp4); a format's training recipes add
#: theirs (``GemmFormat.train_backends``).
BLOCK_BACKENDS = ("emulated", "torch")


def blockscale_capability(fmt: str, backend: str = "emulated",
                          device: str | torch.device | None = None) -> tuple[bool, str]:
    """``(ok, reason)``: can ``fmt`` run with ``backend`` on ``device`` (default: cuda if any)?"""
    if fmt not in BLOCK_SCALED:
        raise ValueError(f"unknown block-scaled format {fmt!r}; expected one of "
                         f"{', '.join(BLOCK_SCALED)}")
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    spec = gemm_format(fmt)
    if backend in spec.train_backends and backend != "torchao":  # nvfp4's own recipe
        base = backend.removeprefix("train-")
        ok, why = blockscale_capability(fmt, base, dev)
        return ok, f"{fmt} training recipe ({backend}): {why}"
    if backend == "torchao" and backend in spec.train_backends:  # MXFP8: torchao trains it
        if importlib.util.find_spec("torchao") is None:
            return False, f"torchao mxfp8: torchao is not installed ({TORCHAO_HINT})"
        ok, why = blockscale_capability(fmt, "torch", dev)
        return True, ("torchao mxfp8: its MXFP8 training GEMMs" + (
            f" ({why})" if ok else f", emulated (KernelPreference.EMULATED; {why})"))
    if backend == "emulated":
        missing = [d for d in spec.emulation_dtypes if not hasattr(torch, d)]
        if missing:
            return False, f"emulated {fmt}: torch {torch.__version__} lacks {', '.join(missing)}"
        return True, f"emulated {fmt}: quantise-dequantise in fp32 (accuracy only)"
    if backend != "torch":
        return False, (f"unknown {fmt} backend {backend!r}; expected one of "
                       f"{', '.join(BLOCK_BACKENDS)}")
    F = torch.nn.functional
    scaling = getattr(F, "ScalingType", None)
    recipe = spec.scaled_mm_recipe
    if not hasattr(F, "scaled_mm") or scaling is None or not hasattr(scaling, recipe):
        return False, (f"torch {fmt}: torch {torch.__version__} has no "
                       f"torch.nn.functional.scaled_mm with ScalingType.{recipe}")
    for d in spec.kernel_dtypes:
        if not hasattr(torch, d):
            return False, f"torch {fmt}: torch {torch.__version__} has no {d}"
    if dev.type != "cuda":
        return False, f"torch {fmt}: needs a CUDA device, this is {dev.type}"
    if not torch.cuda.is_available():
        return False, f"torch {fmt}: CUDA is not available"
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 8):
        return False, f"torch {fmt}: needs CUDA >= 12.8 (block-scaled cuBLAS), torch has {cuda}"
    sm = torch.cuda.get_device_capability(dev.index or 0)
    if sm < (10, 0):
        return False, (f"torch {fmt}: block-scaled GEMMs need Blackwell (SM >= 10.0), "
                       f"this is SM {sm[0]}.{sm[1]}")
    return True, f"torch {fmt}: scaled_mm {recipe} on SM {sm[0]}.{sm[1]}"



def capability(
    precision: str, backend: str | None = None, device: str | torch.device | None = None
) -> tuple[bool, str]:
    """``(ok, reason)`` for running ``precision`` on ``device`` (default: cuda if present).

    For fp8, ``backend`` picks one of ``emulated``/``torch``/``te``; ``None`` means the
    fastest real backend (te, then torch) and does not count emulation as running fp8.
    mxfp8 / nvfp4: ``emulated`` or ``torch`` (block-scaled ``scaled_mm``, SM >= 10.0);
    ``None`` means torch.
    """
    check_precision(precision)
    dev = _device(device)
    if precision == "fp32":
        return True, "fp32: always available"
    fmt = format_of(precision)
    if fmt is not None and fmt.block_scaled:
        return blockscale_capability(precision, backend or "torch", dev)
    if dev.type == "cuda" and not torch.cuda.is_available() and fmt is None:
        return False, (f"{precision}: CUDA is not available here (torch {torch.__version__}"
                       f"{', a CPU build' if torch.version.cuda is None else ''})")
    if precision == "tf32":
        if dev.type == "cuda":
            sm = _cuda_sm(dev)
            if sm is None or sm < (8, 0):
                return False, f"tf32: needs Ampere (SM >= 8.0), this is SM {sm}"
            return True, "tf32: tensor cores via torch.backends.cuda.matmul.allow_tf32"
        return True, f"tf32: emulated on {dev.type} by rounding matmul inputs to 10 mantissa bits"
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        if dev.type == "cuda":
            sm = _cuda_sm(dev)
            if precision == "bf16" and (sm is None or sm < (8, 0)):
                return False, f"bf16: needs Ampere (SM >= 8.0), this is SM {sm}"
            return True, f"{precision}: torch.autocast(cuda, {dtype})"
        if not torch.amp.is_autocast_available(dev.type):
            return False, f"{precision}: torch.autocast does not support {dev.type}"
        note = cpu_16bit_note(precision, cpu_flags()[1]) if dev.type == "cpu" else ""
        return True, f"{precision}: torch.autocast({dev.type}, {dtype})" + (
            f" ({note})" if note else "")
    # fp8
    if backend is not None:
        return fp8_backend_capability(backend, dev)
    reasons = []
    for b in ("te", "torch"):
        ok, why = fp8_backend_capability(b, dev)
        if ok:
            return True, why
        reasons.append(why)
    return False, "; ".join(reasons)


def best_fp8_backend(device: str | torch.device | None = None,
                     training: bool = False) -> tuple[str, str]:
    """The fp8 backend apply uses by default: te, then torch, else emulated; with why.

    ``training`` (the train form): te, then torchao where its fp8 kernels run (the
    library's float8 training), then torch."""
    for b in ("te", "torchao", "torch") if training else ("te", "torch"):
        ok, why = (torchao_fp8_kernels(b, device) if b in TORCHAO_FP8_RECIPES
                   else fp8_backend_capability(b, device))
        if ok:
            return b, why
    _, why_not = capability("fp8", None, device)
    return "emulated", f"emulated fp8 ({why_not})"


def fp8_backends(device: str | torch.device | None = None) -> dict[str, tuple[bool, str]]:
    return {b: fp8_backend_capability(b, device) for b in FP8_BACKENDS}


def runnable_precisions(device: str | torch.device | None = None) -> tuple[str, ...]:
    """Precisions that run here (fp8 counts when at least emulation works)."""
    out = []
    for p in PRECISIONS:
        ok, _ = capability(p, "emulated" if is_gemm_format(p) else None, device)
        if ok:
            out.append(p)
    return tuple(out)


#: CPU features that decide 16-bit matmul speed on a CPU (the team's CPUs differ: AMX-BF16
#: made bf16 matmuls 3x faster than fp32 on one, AVX512-BF16 alone made them slower).
CPU_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f")


def cpu_flags() -> tuple[str, frozenset[str]]:
    """This CPU's model name and its feature flags, from /proc/cpuinfo (no flags when the
    file cannot be read)."""
    name, flags = platform.processor() or "unknown CPU", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
                break
    except OSError:
        pass
    return name, flags


def cpu_16bit_note(precision: str, flags: frozenset[str]) -> str:
    """What this CPU's features say of a 16-bit matmul's speed, as measured on the team's
    CPUs (AMX-BF16: bf16 several times fp32; AVX512-BF16 alone: slower than fp32; AVX2 only:
    a 512x1024x1024 bf16 matmul ~60x slower than fp32). ``--target cpu`` times it."""
    amx, avx512 = f"amx_{precision}", f"avx512_{precision}"
    if amx in flags:
        return f"AMX-{precision.upper()}: on AMX tiles, faster than fp32 here"
    if avx512 in flags:
        return (f"AVX512-{precision.upper()} without AMX: {precision} matmuls measured slower "
                "than fp32 on such a CPU")
    return (f"no {precision} matmul instructions on this CPU: {precision} matmuls run far "
            "slower than fp32 (~60x measured on an AVX2-only CPU)")


def cpu_facts() -> str:
    """This CPU's model name and its 16-bit matmul features, from /proc/cpuinfo."""
    name, flags = cpu_flags()
    if not flags and not Path("/proc/cpuinfo").is_file():
        return f"{name} (no /proc/cpuinfo)"
    have = [f for f in CPU_FLAGS if f in flags]
    lack = [f for f in CPU_FLAGS if f not in flags]
    return (f"{name}; has {', '.join(have) or 'none'}; lacks {', '.join(lack) or 'none'}; "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")


def device_summary() -> dict[str, object]:
    """Versions, devices and capabilities for ``autoprec env``."""
    dev = _device(None)
    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(dev),
        "cuda_available": torch.cuda.is_available(),
        "cpu": cpu_facts(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    info["precisions"] = {
        p: dict(zip(("ok", "reason"), capability(p, None, dev))) for p in PRECISIONS
    }
    info["fp8_backends"] = {
        b: dict(zip(("ok", "reason"), r)) for b, r in fp8_backends(dev).items()
    }
    return info
