"""Gradient passes: the cheap end-to-end estimate, the loss effect and gradient probes.

**Cheap end-to-end estimate** (one backward per batch for all layers and precisions).
Lowering layer l alone perturbs its output by δ_l = y_p − y_fp32; to first order the model
output moves by J_l δ_l (J_l: Jacobian of the outputs w.r.t. y_l). The error the
end-to-end check measures is ||J_l δ_l|| / ||Y||. For a random Gaussian r over the outputs,
E[(rᵀ J_l δ_l)²] = ||J_l δ_l||² (Hutchinson), and rᵀ J_l = ∂(r·Y)/∂y_l is one backward
pass of the scalar r·Y — the same pass for every layer. Samples of a batch do not
interact (eval mode), so splitting the dot product per sample (dim 0) gives one
independent estimate per sample: B per batch instead of one, which is what makes a single
backward accurate enough to rank layers. Several ``probes`` (fresh r) average further.

**Loss effect** (with a loss): the first-order change of the loss, |∂L/∂y_l · δ_l|, from
one backward of the loss (averaged over batches).

**Gradient probes** (with a loss): the layer's backward in precision p given the same
fp32 ∂L/∂y_l, against fp32 (relative L2 over the gradients of its inputs and own weights),
with and without a loss scale for fp16 (``torch.amp.GradScaler`` starts at 2**16); and
the share of nonzero ∂L/∂y_l that flush to zero in p's gradient format (fp8: e5m2).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.formats.gemm import is_forward_only
from autoprec.lower.backends import train_backend
from autoprec.probe.flush import GradFlush
from autoprec.probe.layers import lowered_call
from autoprec.probe.shadow import Call
from autoprec.workload.metrics import iter_floats, relative_error

Key = tuple[str, str]  # (layer path, precision)


def edge_grads(scalar: torch.Tensor, calls: Sequence[Call], retain: bool) -> list[list[Any]]:
    """∂scalar/∂(each call's floating outputs); None where an output does not reach it."""
    return edge_grads_from(scalar, None, calls, [], retain)[0]


def edge_grads_from(output: torch.Tensor, grad_output: torch.Tensor | None,
                    calls: Sequence[Call], extra: Sequence[torch.Tensor], retain: bool
                    ) -> tuple[list[list[Any]], list[Any]]:
    """The vector-Jacobian product of ``output`` with ``grad_output`` (None: ``output`` is
    a scalar) at each call's floating outputs, and at ``extra`` tensors (a block's input:
    ``probe.blockwise``); None where one does not reach ``output``."""
    flat = [(i, j, e) for i, c in enumerate(calls) for j, e in enumerate(c.edges) if e is not None]
    out: list[list[Any]] = [[None] * c.outputs for c in calls]
    if (not flat and not extra) or not output.requires_grad:
        return out, [None] * len(extra)
    # None for an output the scalar does not depend on (its effect is 0); callers tell it
    # from "no gradient edge" (not differentiable: no estimate) by ``Call.edges``.
    grads = torch.autograd.grad(output, [e for _, _, e in flat] + list(extra),
                                grad_outputs=grad_output, retain_graph=retain,
                                allow_unused=True)
    for (i, j, _), g in zip(flat, grads):
        out[i][j] = g
    return out, list(grads[len(flat):])


def random_projection(outputs: Any, gen: torch.Generator) -> torch.Tensor | None:
    """r·Y over the floating outputs that require grad (r ~ N(0, 1), drawn on the CPU)."""
    total = None
    for y in iter_floats(outputs):
        if not y.requires_grad:
            continue
        r = torch.randn(y.shape, generator=gen, dtype=torch.float32).to(y.device, y.dtype)
        term = (r * y).sum()
        total = term if total is None else total + term
    return total


#: How a backward's dot products are split before squaring (see ``Projections``).
SPLITS = ("sample", "row", "element")


def _split(prod: torch.Tensor, split: str) -> torch.Tensor:
    """Σ g·δ per group of the product ``prod = g·δ``, flattened: per sample (dim 0), per row
    (all dims but the last, e.g. per token of a (B, T, C) output) or per element."""
    if prod.dim() == 0:
        return prod.reshape(1)
    if split == "sample":
        return prod.reshape(prod.shape[0], -1).sum(1)
    if split == "row":
        return prod.reshape(-1, prod.shape[-1]).sum(1) if prod.dim() > 1 else prod
    return prod.reshape(-1)


class Projections:
    """Hutchinson sums Σ (rᵀ J δ)² per (layer, precision); see the module docstring.

    ``split="sample"`` is unbiased when samples do not interact; "row" and "element" also
    drop the cross terms between tokens / elements, which vanish on average when rounding
    errors are independent (they mostly are) and cut the variance further.
    """

    def __init__(self) -> None:
        self.sq: dict[str, dict[Key, float]] = {s: defaultdict(float) for s in SPLITS}
        self.seen: set[Key] = set()  # pairs that got a gradient at least once

    # plain dicts and lists in a stage file (probe.stages: torch.load's weights-only reader
    # takes no defaultdict or set)
    def __getstate__(self) -> dict[str, Any]:
        return {"sq": {s: dict(v) for s, v in self.sq.items()}, "seen": sorted(self.seen)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.sq = {s: defaultdict(float, v) for s, v in state["sq"].items()}
        self.seen = {tuple(k) for k in state["seen"]}  # type: ignore[misc]

    def add(self, calls: Sequence[Call], grads: list[list[Any]], weight: float = 1.0) -> None:
        """One backward's grads for this batch's calls; ``weight`` = 1 / probes."""
        # One (layer, precision) pair at a time: only its calls' products are alive (all
        # pairs at once held every call's products of every precision together); each
        # product g·δ is formed once and read by every split.
        keys: dict[Key, list[tuple[Any, torch.Tensor]]] = defaultdict(list)
        for call, gs in zip(calls, grads):
            for p, deltas in call.deltas.items():
                for g, d, edge in zip(gs, deltas, call.edges):
                    if edge is not None:
                        self.seen.add((call.layer.path, p))
                    if g is not None:
                        keys[(call.layer.path, p)].append((g, d))
        for key, pairs in keys.items():
            prods = [g.float() * d for g, d in pairs]
            for split in SPLITS:
                parts = [_split(prod, split) for prod in prods]
                # A layer called twice contributes J1 δ1 + J2 δ2: sum before squaring when
                # the calls line up group by group, else treat them as independent.
                sq = self.sq[split]
                if len({t.shape for t in parts}) == 1:
                    total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
                    sq[key] += weight * float(total.pow(2).sum())
                else:
                    sq[key] += weight * sum(float(t.pow(2).sum()) for t in parts)
                del parts
            del prods


@dataclass
class GradStats:
    """Gradient-probe accumulators of one (layer, precision)."""

    effect: float = 0.0  # Σ over batches |∂L/∂y · δ|
    batches: int = 0
    nonzero: int = 0
    flushed: int = 0  # nonzero ∂L/∂y that become 0 in the gradient format, unscaled
    flushed_scaled: int = 0  # ... with the loss scale
    overflow_scaled: int = 0  # ... that overflow with the loss scale
    sq_err: float = 0.0
    sq_err_scaled: float = 0.0
    sq_ref: float = 0.0
    nonfinite: int = 0
    nonfinite_scaled: int = 0

    @property
    def grad_error(self) -> float:
        return relative_error(self.sq_err, self.sq_ref, self.nonfinite)

    @property
    def grad_error_scaled(self) -> float:
        return relative_error(self.sq_err_scaled, self.sq_ref, self.nonfinite_scaled)

    @property
    def loss_effect(self) -> float:
        return self.effect / self.batches if self.batches else math.nan

    def underflow(self, scaled: bool) -> float:
        if not self.nonzero:
            return 0.0
        return (self.flushed_scaled if scaled else self.flushed) / self.nonzero


class GradProbes:
    """Loss effect and gradient probes from the loss backward of each batch."""

    def __init__(self, loss_scale: float, fp8_backend: str) -> None:
        self.loss_scale = loss_scale
        self.fp8_backend = fp8_backend
        self.stats: dict[Key, GradStats] = defaultdict(GradStats)

    def __getstate__(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "fp8_backend": self.fp8_backend,
                "stats": dict(self.stats)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.loss_scale, self.fp8_backend = state["loss_scale"], state["fp8_backend"]
        self.stats = defaultdict(GradStats, state["stats"])

    def add(self, calls: Sequence[Call], grads: list[list[Any]]) -> None:
        effect: dict[Key, float] = defaultdict(float)
        for call, gs in zip(calls, grads):
            live = [g for g in gs if g is not None]
            # every precision's and scale's counts of a gradient from one pass (flush.py)
            pairs = [(p, s) for p in call.deltas for s in (1.0, self.loss_scale)]
            flush = [GradFlush(g).counts(pairs) for g in live]
            for p, deltas in call.deltas.items():
                key = (call.layer.path, p)
                st = self.stats[key]
                effect[key] += sum(float((g.float() * d).sum())
                                   for g, d in zip(gs, deltas) if g is not None)
                for f in flush:
                    n, fl, _ = f[(p, 1.0)]
                    _, fls, ov = f[(p, self.loss_scale)]
                    st.nonzero += n
                    st.flushed += fl
                    st.flushed_scaled += fls
                    st.overflow_scaled += ov
            if call.inputs is not None and live:
                self._backward_probe(call, gs)
        for key, e in effect.items():
            self.stats[key].effect += abs(e)
            self.stats[key].batches += 1

    def _backward_probe(self, call: Call, gs: list[Any]) -> None:
        """The layer's backward in each precision vs fp32, given the same ∂L/∂y."""
        layer = call.layer
        assert call.inputs is not None
        args, kwargs = _requiring_grad(call.inputs)
        leaves = [t for t in iter_floats((args, kwargs)) if t.requires_grad]
        wrt = leaves + [p for p in layer.module.parameters(recurse=False) if p.requires_grad]
        if not wrt:
            return
        with torch.enable_grad():
            ref = _vjp(lowered_call(layer, "fp32", args, kwargs, self.fp8_backend), gs, wrt, 1.0)
            if ref is None:
                return
            ref_sq = sum(float(r.pow(2).sum()) for r in ref)
            for p in layer.precisions:
                if is_forward_only(p):  # no gradient recipe
                    continue
                st = self.stats[(layer.path, p)]
                st.sq_ref += ref_sq
                scales = (1.0, self.loss_scale) if p == "fp16" else (1.0,)
                # one lowered forward for both scales: its graph is kept for the second
                y = lowered_call(layer, p, args, kwargs, train_backend(p, self.fp8_backend))
                for i, scale in enumerate(scales):
                    low = _vjp(y, gs, wrt, scale, retain=i + 1 < len(scales))
                    if low is None:
                        continue
                    err, bad = _error_and_nonfinite(low, ref)
                    if scale == 1.0:
                        st.sq_err += err
                        st.nonfinite += bad
                    if scale != 1.0 or p != "fp16":
                        st.sq_err_scaled += err
                        st.nonfinite_scaled += bad


def _error_and_nonfinite(low: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, int]:
    """(Σ‖low − ref‖², 0) when every value of ``low`` is finite, else (0.0, how many are
    not). One pass per tensor when all is finite (the common case): a non-finite value of
    ``low`` makes its squared difference non-finite, so only then are they counted."""
    sq = [float((v - r).pow(2).sum()) for v, r in zip(low, ref)]
    if all(math.isfinite(x) for x in sq):
        return sum(sq), 0
    bad = sum(int((~torch.isfinite(v)).sum()) for v in low)
    return (0.0 if bad else sum(sq)), bad


def _requiring_grad(inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[Any, Any]:
    """Fresh leaves requiring grad for every floating tensor of (args, kwargs)."""

    def visit(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                return obj.detach().clone().requires_grad_(True)
            return obj
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(visit(v) for v in obj)
        if isinstance(obj, list):
            return [visit(v) for v in obj]
        if type(obj) is dict:
            return {k: visit(v) for k, v in obj.items()}
        return obj

    args, kwargs = inputs
    return visit(args), visit(kwargs)


def _vjp(output: Any, gs: list[Any], wrt: list[torch.Tensor],
         scale: float, retain: bool = False) -> list[torch.Tensor] | None:
    """Gradients of ``wrt`` for output cotangents ``gs`` (cast to the output's dtype after
    multiplying by ``scale``, as a GradScaler'd backward sees them), divided by ``scale``;
    ``retain`` keeps the output's graph for another call."""
    ys, cots = [], []
    for y, g in zip(iter_floats(output), gs):
        if g is not None and y.requires_grad:
            ys.append(y)
            # x * 1.0 and x / 1.0 are x bit for bit: no pass over the tensor then
            cots.append((g.float() if scale == 1.0 else g.float() * scale).to(y.dtype))
    if not ys:
        return None
    grads = torch.autograd.grad(ys, wrt, cots, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(w, dtype=torch.float32) if g is None
            else g.float() if scale == 1.0 else g.float() / scale
            for g, w in zip(grads, wrt)]
