"""Audit the program ``torch.compile`` builds from an applied model, not an eager forward.

The eager audit (``audit.py``) watches a real forward op by op; a compiled model runs
kernels that no dispatch mode sees. So this compiles the applied model with a capturing
backend (AOT autograd, the graph inductor would receive), reads every GEMM of that graph
(mm / addmm / bmm / baddbmm / convolution / _scaled_mm / SDPA) with the dtypes of its
operands (``node.meta["val"]``) and the module it came from (``node.meta["nn_module_stack"]``,
which dynamo keeps through AOT), and compares them with the plan like the eager audit does.

What counts as which precision: fp16 / bf16 operands as themselves; fp32 operands as fp32
(tf32 on CUDA with its flag on; elsewhere where the module's graph holds the tf32
emulation's mantissa masking); a GEMM of a module whose graph casts to a float8 dtype as
fp8 (the emulated backend multiplies dequantised operands, ``_scaled_mm`` fp8 ones).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from autoprec.apply.audit import _FP8, AuditReport, AuditRow, _fmt, gemm_precision
from autoprec.fused import FUSED_OPS
from autoprec.io.paths import normalize_path, unwrap_model

_GEMM_TARGETS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm")
# a wrapped forward is a method bound to its module (apply._bound_to): `.forward.__func__`
_WRAPPED = re.compile(r"\.forward(?:\.__func__)?\.__closure__.*?__self__")


def _module_path(expr: str) -> str:
    """dynamo's source of a module ("L['module'].encoder.layers[0].forward.__closure__[0]
    .cell_contents.__self__.linear1") -> its path ("encoder.layers.0.linear1")."""
    expr = _WRAPPED.sub("", expr)
    # the root: L['module'] / L['self'], or L['inner'].__self__ / L['fwd'].__closure__[1]
    # .cell_contents.__self__ (reached through the root's own wrapper)
    expr = re.sub(r"^L\[['\"]\w+['\"]\]((\.__closure__\[\d+\]\.cell_contents)*\.__self__)?\.?",
                  "", expr)
    expr = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", expr)
    expr = re.sub(r"\[(\d+)\]", r".\1", expr)
    expr = expr.replace("._modules.", ".").lstrip(".")
    return normalize_path(expr)


def _innermost(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return _module_path(str(list(stack.values())[-1][0]))


def _name(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(target)


def _dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    out = set()
    for a in node.args:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            out.add(val.dtype)
    return out


def compiled_gemms(model: torch.nn.Module, call: Callable[[torch.nn.Module], Any],
                   ) -> tuple[dict[str, Counter[str]], list[str], Any]:
    """Compile ``model`` with a capturing backend, run ``call(compiled)``, and return
    ``{module path: Counter(precision)}`` for the GEMMs of the captured graphs, the fused
    torch.nn kernels found there (they compute without calling the modules rules are on),
    and what ``call`` returned."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture), dynamic=False)
    result = call(compiled)
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    fused: list[str] = []
    for gm in graphs:
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        fp8_modules = {_innermost(n) for n in calls
                       if _name(n) in ("_to_copy", "convert_element_type")
                       and getattr(n.meta.get("val"), "dtype", None) in _FP8}
        # lower.forward.round_to_tf32 (tf32 emulated off CUDA) masks mantissa bits of the operands
        tf32_modules = {_innermost(n) for n in calls if _name(n) == "bitwise_and"}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = _name(node)
            if name in FUSED_OPS:
                fused.append(f"{FUSED_OPS[name]} in {_innermost(node) or 'the model'}")
            if name not in _GEMM_TARGETS and not name.startswith("_scaled_dot_product"):
                continue
            path = _innermost(node)
            if path is None:
                continue
            vals = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
            device = next((v.device.type for v in vals if isinstance(v, torch.Tensor)), "cpu")
            fp8 = path in fp8_modules and not name.startswith("_scaled_dot_product")
            prec = "fp8" if fp8 else gemm_precision(_dtypes(node), name, device)
            if prec == "fp32" and path in tf32_modules:
                prec = "tf32"
            if prec is not None:
                seen[path][prec] += 1
    return seen, fused, result


def audit_compiled(model: torch.nn.Module, layers: dict[str, Any],
                   call: Callable[[torch.nn.Module], Any]) -> AuditReport:
    """The compiled program's GEMMs against the plan: one row per module that ran GEMMs.

    ``layers``: the resolution of every module path (``PolicyHandle.layers``). A GEMM in
    another precision than its module's rule is an error, as in the eager audit; so is a
    graph with no GEMM attributed to a module the plan lowers (the policy was dropped).
    """
    root = unwrap_model(model)
    seen, fused, result = compiled_gemms(model, call)
    rows: list[AuditRow] = []
    errors = [f"compiled: {f} computes without calling the modules the policy rules"
              for f in dict.fromkeys(fused)]
    for path, counter in seen.items():
        r = layers.get(path)
        if r is None:
            continue
        row = AuditRow(path, r.rule_label, r.precision, _fmt(counter), sum(counter.values()))
        rows.append(row)
        if not row.ok:
            errors.append(f"compiled: layer {path!r}: rule {r.rule_label} says {r.precision}, "
                          f"but its GEMMs in the compiled graph compute in {row.computed}")
    if not seen and any(True for _ in root.parameters()):
        errors.append("compiled: the captured graph holds no GEMM attributed to a module")
    report = AuditReport(rows, errors)
    report.result = result
    return report


__all__ = ["audit_compiled", "compiled_gemms"]
