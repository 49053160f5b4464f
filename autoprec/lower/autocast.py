"""What ``torch.autocast`` does to each op, per device type: the cast policy of an op.

Source: ``aten/src/ATen/autocast_mode.{h,cpp}`` (the ``AT_FORALL_*`` lists and the
``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` registrations; PyTorch 2.x) and the
"Autocast Op Reference" of the PyTorch AMP docs. Policies:

- ``lower``: every floating input is cast to the autocast dtype (GEMMs, convs, SDPA);
- ``fp32``: 16-bit inputs are cast to fp32 first (separate cast kernels), output fp32;
- ``fp32_opt`` ("fp32_set_opt_dtype"): the op is called with ``dtype=float32``: it reads
  its 16-bit input directly and writes fp32 (one kernel, no separate cast);
- ``promote``: inputs are cast to the widest floating dtype among them; bf16 mixed with
  fp16 is an error ("Unexpected floating ScalarType in at::autocast::prioritize");
- anything else (``None``): autocast leaves the op alone; it runs in the dtype PyTorch's
  type promotion gives its inputs (bf16 + fp16 -> fp32, 16-bit + fp32 -> fp32).

The names are those ``autoprec.trace.op_recorder`` records: function-level names for what it
records as one op (``linear``, ``conv``, ``scaled_dot_product_attention``), aten packet
names for the rest (``native_layer_norm`` is what ``layer_norm`` runs, ``_softmax`` what
``softmax`` runs).

CUDA and CPU differ: CUDA autocast runs layer_norm, group_norm, softmax, log_softmax, sum,
exp, pow, rsqrt... in fp32; CPU autocast runs them in their input dtype. When accuracy is
measured on a CPU for a CUDA target, the lowered forwards (``lower.forward``) make those
ops run as CUDA would (``TargetFp32Ops`` below), so that the measured error is the deployment's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LOWER_COMMON = frozenset({
    "linear", "conv", "scaled_dot_product_attention", "mm", "bmm", "addmm", "baddbmm",
    "addbmm", "matmul", "convolution", "_convolution", "prelu",
})
_LOWER_CUDA = _LOWER_COMMON | {"mv", "addmv", "addr", "cudnn_convolution",
                               "_scaled_dot_product_flash_attention"}
_FP32_CUDA = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "native_group_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss_forward", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "norm",
})
_FP32_OPT_CUDA = frozenset({"prod", "_softmax", "softmax", "_log_softmax", "log_softmax",
                            "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                            "sum"})
_PROMOTE_CUDA = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot",
                           "grid_sampler", "index_put", "tensordot", "scatter_add"})
_FP32_CPU = frozenset({
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile",
    "nanquantile", "stft", "cdist", "trace", "max_pool3d", "adaptive_avg_pool3d",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss_forward",
    "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
    "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
})
_PROMOTE_CPU = frozenset({"stack", "cat", "index_copy"})

POLICIES = ("lower", "fp32", "fp32_opt", "promote")


#: Each device's autocast op lists, in the order autocast consults them.
_LISTS = {
    "cuda": ((_LOWER_CUDA, "lower"), (_FP32_CUDA, "fp32"), (_FP32_OPT_CUDA, "fp32_opt"),
             (_PROMOTE_CUDA, "promote")),
    "cpu": ((_LOWER_COMMON, "lower"), (_FP32_CPU, "fp32"), (_PROMOTE_CPU, "promote")),
}


def cast_policy(op_name: str, device_type: str) -> str | None:
    """The autocast cast policy of a recorded op on ``device_type`` (None: left alone)."""
    if op_name.startswith("_scaled_dot_product"):
        return "lower"
    lists = _LISTS["cuda" if device_type == "cuda" else "cpu"]
    return next((policy for ops, policy in lists if op_name in ops), None)


# -- running CUDA's fp32 list on a CPU -------------------------------------------------------

_F = torch.nn.functional


def _callables(op: str) -> list[Any]:
    """The public Python callables that run aten op ``op`` (``torch.X``, ``Tensor.X``,
    ``F.X``, ``torch.linalg.X`` for ``linalg_X``; ``Tensor.__pow__`` for ``pow``)."""
    if op.startswith("_"):
        return []  # private aten entry points (torch._softmax) take no dtype; their
        # public callers (softmax) are listed under their own names
    spaces: list[tuple[Any, str]] = [(torch, op), (torch.Tensor, op), (_F, op)]
    if op.startswith("linalg_"):
        spaces = [(torch.linalg, op.removeprefix("linalg_"))]
    found = [f for ns, name in spaces if (f := getattr(ns, name, None)) is not None]
    if op == "pow":
        found.append(torch.Tensor.__pow__)
    return found


def _target_fp32() -> dict[Any, str]:
    """Functions CUDA autocast runs in fp32 that CPU autocast does not, from the op lists
    above (one source for the schedule and for apply): "cast" (fp32 list: 16-bit inputs
    cast to fp32 first) or "opt" (fp32_set_opt_dtype: called with ``dtype=float32``)."""
    table: dict[Any, str] = {}
    cpu = _FP32_CPU | _PROMOTE_CPU | _LOWER_COMMON
    for ops, how in ((_FP32_CUDA, "cast"), (_FP32_OPT_CUDA, "opt")):
        for op in sorted(ops - cpu):
            for f in _callables(op):
                table.setdefault(f, how)
    return table


#: Function -> how CUDA autocast keeps it in fp32, for ``TargetFp32Ops``.
_TARGET_FP32 = _target_fp32()
_LOW = (torch.float16, torch.bfloat16)


def _up(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in _LOW else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_up(v) for v in obj)
    return obj


def _has_low(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.dtype in _LOW
    if isinstance(obj, (list, tuple)):
        return any(_has_low(v) for v in obj)
    return False


#: CPU autocast's promote ops that CUDA autocast leaves alone (plain type promotion): on a
#: CPU, a fp16 tensor in a bf16 region's cat is an error ("Unexpected floating ScalarType
#: in at::autocast::prioritize"); on CUDA it is concatenated as it is.
_NATIVE_PROMOTE = {torch.cat, torch.stack, torch.concat, torch.concatenate}


class TargetFp32Ops(TorchFunctionMode):
    """Inside an autocast region on a CPU, run ops as CUDA autocast would: the ones CUDA
    keeps in fp32 in fp32, and ``cat``/``stack`` with plain type promotion.

    Active only while ``suspended`` is 0 (a fp32/tf32 island inside suspends it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.suspended = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _NATIVE_PROMOTE and not self.suspended and _has_low(args):
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        how = _TARGET_FP32.get(func)
        if how is None or self.suspended or not _has_low((args, kwargs)):
            return func(*args, **kwargs)
        if how == "opt" and kwargs.get("dtype") is None:
            return func(*args, **{**kwargs, "dtype": torch.float32})
        return func(*_up(args), **{k: _up(v) for k, v in kwargs.items()})


#: The modes now entered (innermost last): one per outermost autocast region.
_ACTIVE: list[TargetFp32Ops] = []


@contextlib.contextmanager
def target_fp32_ops() -> Iterator[None]:
    """Enter TargetFp32Ops unless an enclosing region already did (un-suspending it)."""
    if _ACTIVE:
        mode = _ACTIVE[-1]
        was = mode.suspended
        mode.suspended = 0
        try:
            yield
        finally:
            mode.suspended = was
        return
    mode = TargetFp32Ops()
    _ACTIVE.append(mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.remove(mode)


@contextlib.contextmanager
def suspend_target_fp32_ops() -> Iterator[None]:
    """A fp32/tf32 island: its ops run as written (autocast is off there anyway)."""
    if not _ACTIVE:
        yield
        return
    mode = _ACTIVE[-1]
    mode.suspended += 1
    try:
        yield
    finally:
        mode.suspended -= 1


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The surrounding compute dtype a GEMM-format backend gives its output in: the
    autocast dtype if one is active on ``x``'s device, else ``x``'s own (fp32 for a
    non-floating ``x``)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype if x.is_floating_point() else torch.float32


__all__ = ["POLICIES", "TargetFp32Ops", "cast_policy", "compute_dtype", "suspend_target_fp32_ops",
           "target_fp32_ops"]
