"""fp8 training through torchao's float8 training: fprop, dgrad and wgrad in fp8.

The ``torchao`` fp8 backend runs a Linear-like leaf through ``torchao.float8``: an
``nn.Linear`` as the ``Float8Linear`` that ``convert_to_float8_training`` makes of it
(sharing the leaf's weight and bias Parameters: the fp32 masters and their gradients stay
the model's own), HF's ``Conv1D`` (weight stored (in, out)) through the same autograd
function ``Float8Linear.forward`` calls. Its recipes (``RECIPES``):

- ``tensorwise`` (backend ``torchao``): the policy's fp8, the recipe the home-made
  ``emulated`` backend computes (``lower.fp8``): e4m3 input and weight forward, e5m2 output
  gradient backward, one fp32 scale per tensor from its amax (current scaling), every GEMM
  accumulating in fp32. tests/lower/test_torchao_fp8.py compares the two numerically.
- ``rowwise`` (backend ``torchao-rowwise``): a scale per row of each operand along the
  GEMM's contraction dim, rounded down to a power of two, e4m3 gradients too; better on
  outliers, real kernels need SM >= 9.0.

Where the device has fp8 tensor cores (CUDA SM >= 8.9; rowwise SM >= 9.0) the three GEMMs
are ``torch._scaled_mm`` (``emulate=False``; ``pad_inner_dim`` pads the token count, wgrad's
inner dim, to a multiple of 16); elsewhere torchao's own emulation (``emulate=True``:
quantise through float8 dtypes, dequantise, fp32 ``mm``) runs the same arithmetic.

MXFP8 (policy precision ``mxfp8``, training form, where the block-scaled kernels run:
Blackwell): torchao's MXFP8 training GEMM (``prototype.moe_training``'s
``_to_mxfp8_then_scaled_mm``, what its ``MXFP8TrainingOpConfig`` runs for a Linear): e4m3
blocks of 32 with RCEIL E8M0 scales for every operand, each GEMM quantising along its own
reduction dim: the recipe ``lower.blockscale`` emulates (``torchao_mxfp8_linear``).

Delayed scaling: torchao 0.18 offers ``ScalingType.DYNAMIC`` (current scaling) and
``DISABLED`` only (delayed scaling was removed from ``torchao.float8``); here only
Transformer Engine's recipes have it (the ``te`` backend).

``Float8GemmRecorder`` proves which GEMMs ran through the library: a dispatch mode that
sees every GEMM whose operands are torchao's fp8 tensors (forward and backward) and the
casts to fp8, attributed to the leaf that ran them (``apply.fp8_training_audit``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec.device.capability import TORCHAO_FP8_RECIPES, TORCHAO_HINT, TORCHAO_MIN_SM
from autoprec.formats.gemm import stores_in_out
from autoprec.io.extras import require
from autoprec.lower.autocast import compute_dtype

#: fp8 backend name -> torchao float8 training recipe.
RECIPES = TORCHAO_FP8_RECIPES
#: Where a leaf keeps its library module (not a registered submodule: state_dict, named
#: modules and the policy's paths stay the model's own); dropped with the policy.
CACHE_ATTR = "_autoprec_float8"
INSTALL_HINT = TORCHAO_HINT
MIN_SM = TORCHAO_MIN_SM


def torchao_installed() -> bool:
    """Whether ``torchao`` can be found (without importing it: the import takes seconds)."""
    return importlib.util.find_spec("torchao") is not None


_FLOAT8: ModuleType | None = None


def import_float8() -> ModuleType:
    """``torchao.float8`` (imported once: a compiled forward then reads a module global
    instead of graph-breaking on the import); MissingExtra (exit 2) naming the extra when
    torchao is not installed."""
    global _FLOAT8
    if _FLOAT8 is None:
        require("torchao", "the torchao fp8 backend")  # MissingExtra naming train-fp8
        importlib.import_module("torchao.float8.float8_linear")
        _FLOAT8 = importlib.import_module("torchao.float8")
    return _FLOAT8


def real_kernels(device: torch.device, recipe: str = "tensorwise") -> bool:
    """Whether ``recipe``'s GEMMs run as real fp8 kernels on ``device`` (else emulate)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device.index or 0) >= MIN_SM[recipe]


def float8_config(recipe: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``emulate`` off the fp8 kernels."""
    if recipe not in MIN_SM:
        raise ValueError(f"unknown torchao float8 recipe {recipe!r}; expected one of "
                         f"{', '.join(MIN_SM)}")
    cfg = import_float8().Float8LinearConfig.from_recipe_name(recipe)
    # the token count is the inner dim of wgrad; _scaled_mm wants it a multiple of 16
    return dataclasses.replace(cfg, emulate=emulate, pad_inner_dim=not emulate)


@dataclasses.dataclass
class _Runner:
    """A leaf's library path: the Float8Linear (nn.Linear) or the config of the autograd
    function a Conv1D calls, keyed by what it was built for."""

    key: tuple[Any, ...]
    module: torch.nn.Module  # a Float8Linear (for a Conv1D: one on meta, for its mm config)
    shares: bool  # the Float8Linear holds the leaf's own weight/bias Parameters


def _runner(leaf: torch.nn.Module, recipe: str, emulate: bool) -> _Runner:
    """The leaf's Float8Linear, built once per (recipe, emulate, weight Parameter)."""
    key = (recipe, emulate)
    cached = leaf.__dict__.get(CACHE_ATTR)
    if cached is not None and cached.key == key and (not cached.shares or (
            cached.module.weight is leaf.weight and cached.module.bias is leaf.bias)):
        return cached  # a Parameter replaced (model.to, a swap) builds a new one
    f8 = import_float8()
    cfg = float8_config(recipe, emulate)
    if isinstance(leaf, torch.nn.Linear):
        # a root nn.Linear is not modified in place: a new Float8Linear on its Parameters
        mod = f8.convert_to_float8_training(leaf, config=cfg)
        if not isinstance(mod, f8.float8_linear.Float8Linear) or mod.weight is not leaf.weight:
            raise RuntimeError(f"torchao did not convert {type(leaf).__name__} to a "
                               "Float8Linear sharing its weight")
        out = _Runner(key, mod, shares=True)
    elif stores_in_out(leaf):
        k, n = leaf.weight.shape  # (in, out): already the (K, N) operand Float8Linear uses
        mod = f8.float8_linear.Float8Linear(k, n, bias=False, config=cfg, device="meta")
        out = _Runner(key, mod, shares=False)
    else:
        raise ValueError(f"torchao fp8: {type(leaf).__name__} is not a Linear-like GEMM")
    leaf.__dict__[CACHE_ATTR] = out
    return out


def prepare(module: torch.nn.Module, recipe: str = "tensorwise") -> None:
    """Build ``module``'s library module now (on its weight's device), so that the first
    forward, compiled or not, finds it: torch.compile cannot trace its construction."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        _runner(module, recipe, emulate=not real_kernels(weight.device, recipe))


def torchao_linear(module: torch.nn.Module, x: torch.Tensor, recipe: str = "tensorwise"
                   ) -> torch.Tensor:
    """Run the Linear-like ``module`` on ``x`` through torchao's float8 training.

    The output is in the surrounding compute dtype (an autocast region's, else ``x``'s),
    as the other fp8 backends give it; autocast is off inside (the fp8 math is explicit).
    """
    out_dtype = compute_dtype(x)
    run = _runner(module, recipe, emulate=not real_kernels(x.device, recipe))
    with torch.autocast(x.device.type, enabled=False), _leaf_scope(module):
        if run.shares:
            y = run.module(x.to(out_dtype))
        else:
            f8l = import_float8().float8_linear
            f = run.module
            y = f8l.matmul_with_hp_or_float8_args.apply(
                x.to(out_dtype), module.weight, f.linear_mm_config, f.config)
            if module.bias is not None:
                y = y + module.bias.to(y.dtype)
    _mark_backward(module, y)
    return y


def torchao_mxfp8_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run the Linear-like ``module`` on ``x`` (..., K) through torchao's MXFP8 training
    GEMM: its kernels where ``blockscale_capability("mxfp8", "torch")`` says they run,
    else its emulation (``KernelPreference.EMULATED``). Output in the compute dtype."""
    require("torchao", "the torchao mxfp8 backend")
    try:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as err:  # installed, but a release without MXFP8 training
        raise ImportError(f"the torchao mxfp8 backend needs torchao's MXFP8 training "
                          f"(prototype.moe_training): {INSTALL_HINT}") from err
    from autoprec.device.capability import blockscale_capability
    from autoprec.formats.gemm import linear_weight

    out_dtype = compute_dtype(x)
    real = blockscale_capability("mxfp8", "torch", x.device)[0]
    pref = KernelPreference.AUTO if real else KernelPreference.EMULATED
    # emulated: fp32 operands (a bf16 input is exact in fp32; the fp32 masters quantised
    # from fp32), as the home-made emulation reads them; the kernels take bf16 operands
    # (torchao's MXFP8 training casts from a bf16 model)
    hp = torch.bfloat16 if real else torch.float32
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(hp)  # (M, K)
    m = x2.shape[0]
    pad = (-m) % 32  # wgrad quantises along the tokens: M in whole blocks of 32 (zero rows
    if pad:  # leave each block's amax, hence every value, as the home-made padding does)
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    with torch.autocast(x.device.type, enabled=False):
        y = _to_mxfp8_then_scaled_mm(x2, linear_weight(module).to(hp), pref,
                                     ScaleCalculationMode.RCEIL)[:m]
        bias = getattr(module, "bias", None)
        if bias is not None:
            y = y.float() + bias.float()
    return y.to(out_dtype).reshape(*shape[:-1], y.shape[-1])


# -- the recorder: which GEMMs ran in fp8 through the library, for which leaf -------------

#: GEMM name by the roles of its two fp8 operands (torchao's GemmInputRole values).
_GEMMS = {frozenset({"input", "weight"}): "fprop", frozenset({"grad_output", "weight"}): "dgrad",
          frozenset({"grad_output", "input"}): "wgrad"}
_SHORT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_state = threading.local()


@dataclasses.dataclass(frozen=True)
class LibraryGemm:
    """One GEMM torchao ran on fp8 operands: which leaf, which GEMM, the operand formats."""

    leaf: str
    gemm: str  # fprop / dgrad / wgrad (or "other")
    operands: tuple[str, str]  # e.g. ("e5m2", "e4m3")
    emulated: bool  # torchao's emulate=True (not the fp8 kernels)


class Float8GemmRecorder(TorchDispatchMode):
    """Records the GEMMs whose operands are torchao fp8 tensors, and the casts to fp8.

    ``paths``: leaf module -> its path (leaves the torchao backend runs announce
    themselves in forward and, through a hook on the library's backward node, in backward).
    """

    def __init__(self, paths: Mapping[torch.nn.Module, str]) -> None:
        super().__init__()
        self.paths = {id(m): p for m, p in paths.items()}
        self.gemms: list[LibraryGemm] = []
        self.casts: Counter[str] = Counter()  # leaf -> casts to an fp8 dtype

    def __enter__(self) -> Float8GemmRecorder:
        stack = getattr(_state, "recorders", [])
        _state.recorders = [*stack, self]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _state.recorders = [r for r in getattr(_state, "recorders", []) if r is not self]
        super().__exit__(*exc)

    def _leaf(self) -> str:
        mod = getattr(_state, "leaf", None)
        return "?" if mod is None else self.paths.get(id(mod), "?")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        f8 = _float8_operands(args)
        if len(f8) == 2 and func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            roles = frozenset(t._gemm_input_role.value for t in f8)
            order = sorted(f8, key=lambda t: t._gemm_input_role.value != "grad_output")
            self.gemms.append(LibraryGemm(
                self._leaf(), _GEMMS.get(roles, "other"),
                tuple(_SHORT.get(t._data.dtype, str(t._data.dtype)) for t in order),  # type: ignore[arg-type]
                bool(f8[0]._linear_mm_config.output.emulate)))
        elif not f8 and func.overloadpacket is torch.ops.aten._to_copy \
                and kwargs.get("dtype") in _SHORT:
            self.casts[self._leaf()] += 1
        return func(*args, **kwargs)


def _float8_operands(args: Any) -> list[Any]:
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return [a for a in args if isinstance(a, Float8TrainingTensor)]


def _recording() -> bool:
    return bool(getattr(_state, "recorders", None))


@contextmanager
def _leaf_scope(module: torch.nn.Module) -> Iterator[None]:
    """The recorder attributes what runs inside to ``module`` (only while one records)."""
    if not _recording():
        yield
        return
    old = getattr(_state, "leaf", None)
    _state.leaf = module
    try:
        yield
    finally:
        _state.leaf = old


def _mark_backward(module: torch.nn.Module, y: torch.Tensor) -> None:
    """While a recorder records: announce ``module`` right before the library's backward
    node for this call runs (a pre-hook on that node: nothing runs between the two)."""
    if not _recording() or y.grad_fn is None:
        return
    todo, seen = [y.grad_fn], set()
    while todo:  # the output's node, or a bias add above it
        node = todo.pop()
        if node is None or id(node) in seen or len(seen) > 4:
            continue
        seen.add(id(node))
        if "matmul_with_hp_or_float8_args" in type(node).__name__:
            def announce(grad_outputs: Any, module: torch.nn.Module = module) -> None:
                _state.leaf = module
            node.register_prehook(announce)
            return
        todo.extend(n for n, _ in node.next_functions)


__all__ = ["CACHE_ATTR", "Float8GemmRecorder", "INSTALL_HINT", "LibraryGemm", "RECIPES",
           "float8_config", "import_float8", "prepare", "real_kernels", "torchao_installed",
           "torchao_linear", "torchao_mxfp8_linear"]
