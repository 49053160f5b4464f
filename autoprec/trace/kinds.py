"""Op kinds of modules, and which precisions each module may take (with the reason why not).

A module's kind comes from its type when the type says it (``nn.Linear``, ``nn.Conv2d``,
``nn.LayerNorm``...) and otherwise from the aten ops its *own* code ran on the measured
forward (children excluded): a module whose own code runs SDPA or a matmul next to a
softmax is "attention" even though forward hooks never see those functional calls.

Eligibility follows docs/overview.md "Precisions":
- GEMM kinds (linear, conv, attention, matmul) may take fp32, tf32, bf16 and fp16;
  fp8 only Linear-like leaves (``nn.Linear``, HF ``Conv1D``) with both dims multiples of 16
  (``torch._scaled_mm`` wants K and N divisible by 16).
- Containers holding GEMMs may take every precision; an fp8 rule on a container applies to
  its fp8-eligible GEMM leaves, so fp8 needs at least one of those inside.
- Everything else runs no autocast-eligible op: a bf16/fp16 rule would change nothing
  (autocast keeps norms and softmax in fp32 and runs pointwise ops in their input dtype),
  tf32 only changes matmul/conv inputs, and fp8 is for GEMMs only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

# One definition of "Linear-like" (nn.Linear, HF Conv1D) and of each format's alignment
# rule: the formats' own.
from autoprec.formats.gemm import gemm_format, is_linear_like, linear_dims
from autoprec.formats.precisions import GEMM_FORMATS, PRECISIONS
from autoprec.fused import not_called_reason
from autoprec.trace.graph import GEMM_KINDS

#: aten op names (``OpOverloadPacket.__name__``) and torch/fx function names of GEMMs.
MATMUL_OPS = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "__matmul__", "mv", "addmv",
        "dot", "vdot", "einsum", "linear", "_scaled_mm", "chain_matmul",
    }
)  # fmt: skip
CONV_OPS = frozenset(
    {
        "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
        "conv_transpose2d", "conv_transpose3d", "_slow_conv2d_forward", "cudnn_convolution",
        "mkldnn_convolution", "convolution_overrideable",
    }
)  # fmt: skip
ATTENTION_OPS = frozenset(
    {
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
        "_flash_attention_forward", "_efficient_attention_forward", "flex_attention",
    }
)  # fmt: skip
GEMM_OPS = MATMUL_OPS | CONV_OPS | ATTENTION_OPS

NORM_OPS = frozenset(
    {
        "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
        "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
        "instance_norm", "rms_norm", "_fused_rms_norm",
    }
)  # fmt: skip
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
EMBEDDING_OPS = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
DROPOUT_OPS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
# Ops that only describe or re-view data: they move no activation through compute.
VIEW_OPS = frozenset(
    {
        "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze",
        "unsqueeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind",
        "alias", "detach", "clone", "contiguous", "as_strided", "_to_copy", "to", "lift_fresh",
        "empty", "empty_like", "zeros", "ones", "full", "arange", "zeros_like", "ones_like",
        "full_like", "new_empty", "new_zeros", "new_ones", "scalar_tensor", "copy_", "item",
        "_local_scalar_dense", "sym_size", "sym_numel", "flatten", "unflatten", "expand_as",
        "view_as", "_reshape_alias", "index_select", "cat", "stack",
    }
)  # fmt: skip


def _what_runs(module: nn.Module, kind: str, own_ops: Iterable[str]) -> str:
    """E.g. "layer_norm runs in fp32 under autocast" for a non-GEMM leaf.

    Autocast's CUDA op lists: norms and softmax are fp32-listed, embedding runs in its
    weight's dtype, everything else (pointwise) in the widest input dtype.
    """
    # Show ops as users know them: aten's native_layer_norm is F.layer_norm.
    ops = sorted({o.removeprefix("native_").lstrip("_") for o in own_ops} - VIEW_OPS)
    if kind in ("norm", "softmax"):
        named = [o for o in ops if o in NORM_OPS | SOFTMAX_OPS]
        what = named[0] if named else type(module).__name__
        return f"{what} runs in fp32 under autocast"
    if kind == "embedding":
        return "embedding runs in its weight's dtype"
    if not ops:
        return f"{type(module).__name__} runs in its input's dtype under autocast"
    if len(ops) == 1:
        return f"{ops[0]} runs in its input's dtype under autocast"
    return f"{', '.join(ops[:3])} run in their input's dtype under autocast"


def _is_norm_type(module: nn.Module) -> bool:
    if isinstance(
        module,
        (
            nn.LayerNorm,
            nn.GroupNorm,
            nn.modules.batchnorm._NormBase,
            nn.RMSNorm,
            nn.LocalResponseNorm,
        ),
    ):
        return True
    # HF's LlamaRMSNorm, T5LayerNorm... are plain nn.Modules named *Norm.
    name = type(module).__name__
    return name.endswith("Norm") or name.endswith("LayerNorm")


def _is_activation_type(module: nn.Module) -> bool:
    if type(module).__module__ == nn.modules.activation.__name__:
        return not isinstance(
            module, (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.MultiheadAttention)
        )
    # transformers.activations: GELUActivation, NewGELUActivation, SiLUActivation...
    return type(module).__module__.endswith(".activations")


def classify(module: nn.Module, own_ops: Iterable[str], has_children: bool) -> str:
    """The op kind (one of ``graph.KINDS``) of ``module`` given the aten ops of its own code."""
    ops = set(own_ops)
    if not_called_reason(module) is not None:
        return "other"  # MHA's out_proj: its GEMM runs in (and is priced as) the attention
    if is_linear_like(module):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd) or ops & CONV_OPS:
        return "conv"
    if isinstance(module, nn.MultiheadAttention) or ops & ATTENTION_OPS:
        return "attention"
    if ops & MATMUL_OPS:
        # q @ k.T followed by a softmax in the same code is attention; a bare matmul is not.
        return "attention" if ops & SOFTMAX_OPS else "matmul"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or (
        not has_children and ops & EMBEDDING_OPS
    ):
        return "embedding"
    if _is_norm_type(module) or (not has_children and ops & NORM_OPS):
        return "norm"
    if isinstance(module, (nn.Softmax, nn.LogSoftmax, nn.Softmin)) or (
        not has_children and ops & SOFTMAX_OPS
    ):
        return "softmax"
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return "dropout"
    if _is_activation_type(module):
        return "activation"
    if has_children:
        return "container"
    if type(module).__module__ == nn.modules.pooling.__name__ or any("pool" in o for o in ops):
        return "other"  # pooling: a reduction over windows, not pointwise
    if ops - VIEW_OPS - DROPOUT_OPS:
        return "elementwise"  # e.g. a custom Scale module: pointwise compute only
    return "other"  # Identity, Flatten, pooling...


def format_reason(module: nn.Module, kind: str, precision: str = "fp8") -> str | None:
    """Why a leaf may not take GEMM format ``precision`` (fp8/mxfp8/nvfp4; None: it may)."""
    dims = linear_dims(module)
    if dims is None:
        if kind in ("conv", "attention", "matmul"):
            return (f"{kind} is not Linear-like ({precision} backends run nn.Linear / Conv1D "
                    "GEMMs only)")
        return "not a GEMM"
    fmt = gemm_format(precision)
    why = not_called_reason(module)
    if why is not None:
        return why
    return ", ".join(fmt.shape_problems(*dims)) or None  # every misaligned dim, by the format


def eligibility(
    module: nn.Module,
    kind: str,
    own_ops: Iterable[str],
    subtree_gemms: int = 0,
    subtree_formats: Mapping[str, int] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(allowed precisions, {precision: reason}) for one module.

    ``subtree_gemms`` / ``subtree_formats``: GEMM nodes, and per GEMM format the Linear
    leaves eligible for it, among the module's descendants (used for containers).
    """
    disallowed: dict[str, str] = {}
    never = not_called_reason(module)
    if never is not None:  # no rule can hold here
        return [], dict.fromkeys(PRECISIONS, never)
    is_leaf = not any(True for _ in module.children())
    below = subtree_formats or {}
    if not is_leaf and (subtree_gemms or kind in GEMM_KINDS):
        # A format rule here applies to the eligible Linear leaves inside (docs/overview.md).
        for f in GEMM_FORMATS:
            if isinstance(module, nn.MultiheadAttention):
                disallowed[f] = ("nn.MultiheadAttention computes in_proj and out_proj from "
                                 "their weights (F.multi_head_attention_forward), never "
                                 f"calling a Linear a {f} backend could run")
            elif not below.get(f):
                disallowed[f] = (f"no {f}-eligible Linear inside "
                                 f"({gemm_format(f).aligned_dims})")
    elif kind in GEMM_KINDS:
        for f in GEMM_FORMATS:
            why = format_reason(module, kind, f)
            if why is not None:
                disallowed[f] = why
    else:
        # Show the op as users know it: aten's native_layer_norm is F.layer_norm.
        if is_leaf:
            reason = f"no autocast-eligible op ({_what_runs(module, kind, own_ops)})"
        else:
            reason = "no autocast-eligible op inside (no matmul/conv runs in this module)"
        disallowed["tf32"] = "tf32 only changes matmul/conv inputs; none runs here"
        disallowed["bf16"] = reason
        disallowed["fp16"] = reason
        for f in GEMM_FORMATS:
            disallowed[f] = "not a GEMM"
    allowed = [p for p in PRECISIONS if p not in disallowed]
    return allowed, disallowed
