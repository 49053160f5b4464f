"""GEMMs that inductor runs unfolded: a Linear over a transposed 3-D input with a cast weight.

``x @ W.t()`` with a 3-D ``x`` (``F.linear`` on ``(T, B, K)``) is "folded" into one 2-D
GEMM: ``x`` is reshaped to ``(T * B, K)`` — a copy when ``x`` is not contiguous, as
``nn.MultiheadAttention``'s ``batch_first`` input is after its ``transpose(1, 0)`` — and
multiplied by ``W.t()`` once. Both eager and inductor fold (``torch._decomp.decompositions
.should_fold``) when the weight operand requires grad or ``x`` is contiguous. An fp32
parameter requires grad, so the recorded forward (fp32, ``no_grad``) ran the fold. The
recorder keeps a Linear as one ``linear`` op whose recipe holds the transposed input; a
model's own ``torch.matmul(x, W.t())`` shows the fold itself: a ``clone`` of the transposed
input, an ``_unsafe_view`` and an ``mm``. Both are matched.

Under a plan that casts that weight — autocast's per-call cast in the training form — the
GEMM's weight operand is the cast's output, which under ``no_grad`` does not require grad,
and ``x`` is not contiguous: inductor does not fold. It lowers the Linear to
``bmm(x, W.t().expand(T, K, N))``, and on a CPU the batched GEMM copies the stride-0 expanded
weight ``T`` times before it multiplies ``T`` small ``(B, K) @ (K, N)`` products
(measured: docs/cost_history.md). Eager autocast folds and the deploy form's stored bf16
weight is a parameter (it requires grad), so both run the folded GEMM.

``unfolded_gemms`` finds these GEMMs in a recorded forward and gives each the recipe of the
``bmm`` inductor runs instead; ``measure.ops`` times it on this machine
(``OpTimes.compute_unfolded``) and the compiled cost model prices a row with it wherever
the row reads the GEMM's weight in another dtype than the parameter's (a cast weight). Only
3-D inputs are matched (a 4-D one would flatten its leading dimensions first). Without op
timings (a GPU profile) nothing changes: the roofline prices the same FLOPs either way, and
whether cuBLAS copies a stride-0 batch was not measured.
"""

from __future__ import annotations

from typing import Any

from autoprec.trace.ops import OpTrace


def non_contiguous(shape: list[int], stride: list[int]) -> bool:
    """``should_fold``'s test: not laid out row-major (dimensions of size 1 ignored)."""
    expect, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        expect[d] = acc
        acc *= shape[d]
    return any(n != 1 and s != e for n, s, e in zip(shape, stride, expect, strict=True))


def _folded_input(trace: OpTrace, i: int, producer: dict[int, int]
                  ) -> tuple[dict[str, Any], int, str] | None:
    """(input spec, weight value, weight dtype) of GEMM ``i`` when it is ``x @ W.t()`` of a
    parameter ``W`` and a 3-D ``x``: an ``F.linear`` op, or the folded ``mm`` of a
    ``matmul`` (a ``clone`` of ``x``, an ``_unsafe_view`` and the ``mm`` over ``W.t()``)."""
    op = trace.ops[i]
    vals = trace.values
    if op.recipe is None or len(op.inputs) < 2:
        return None
    if op.name == "linear":
        x, w = op.recipe["a"][0], op.recipe["a"][1]
        if not isinstance(x, dict) or vals[op.inputs[1]].source != "param":
            return None
        return x, op.inputs[1], w["dt"]
    if op.name != "mm" or len(op.inputs) != 2:
        return None
    a, b = op.inputs
    view = trace.ops[producer[a]] if a in producer else None
    clone = (trace.ops[producer[view.inputs[0]]]
             if view is not None and view.name == "_unsafe_view" and view.inputs
             and view.inputs[0] in producer else None)
    wt = trace.ops[producer[b]] if b in producer else None
    if (clone is None or clone.name != "clone" or clone.recipe is None
            or wt is None or wt.name != "t" or not wt.inputs
            or vals[wt.inputs[0]].source != "param" or not clone.recipe["a"]):
        return None
    return clone.recipe["a"][0], wt.inputs[0], op.recipe["a"][1]["dt"]


def unfolded_gemms(trace: OpTrace) -> dict[int, dict[str, Any]]:
    """Op index of each Linear GEMM whose input was a non-contiguous 3-D tensor and whose
    weight is a parameter -> the ``aten.bmm`` recipe inductor runs when that weight is cast
    (see the module docs)."""
    producer: dict[int, int] = {}
    for i, op in enumerate(trace.ops):
        for o in op.outputs:
            producer.setdefault(o, i)
    vals = trace.values
    out: dict[int, dict[str, Any]] = {}
    for i in range(len(trace.ops)):
        got = _folded_input(trace, i, producer)
        if got is None:
            continue
        src, w, wdt = got
        if not isinstance(src, dict) or "t" not in src or len(src["shape"]) != 3:
            continue
        shape, stride = list(src["shape"]), list(src["stride"])
        if not non_contiguous(shape, stride):
            continue
        d0, d1, k = shape
        n = vals[w].numel // k
        # the batch dimension of the model is the outermost in memory (largest stride)
        bdim = max(range(2), key=lambda d: stride[d]) if vals[src["t"]].scales else 0
        x = {"t": src["t"], "shape": [d0, d1, k], "stride": [d1 * k, k, 1], "dt": src["dt"],
             "bdim": bdim}
        weight = {"t": w, "shape": [d0, k, n], "stride": [0, 1, k], "dt": wdt}
        out[i] = {"f": "aten.bmm.default", "a": [x, weight], "k": {}}
    return out


__all__ = ["non_contiguous", "unfolded_gemms"]
