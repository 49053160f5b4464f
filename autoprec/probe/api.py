"""``probe()``: orchestrates the probes (no numerics here; see shadow/grads/e2e/rows).

Cost over the calibration data, in forward-pass equivalents (a backward counts 2):
one fp32 pass with shadow hooks (1 + one lowered evaluation of every layer per precision),
``probes`` backwards for the cheap end-to-end estimate, with a loss one more backward and
the per-layer gradient probes, plus one pass per end-to-end run (a streamed model: one
more forward without gradients, ``blockwise``'s capture). Naive probing runs the whole
model once per (layer, precision).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from autoprec.device.capability import runnable_precisions
from autoprec.errors import InputError
from autoprec.formats.precisions import PRECISIONS, check_precision
from autoprec.fused import fused_paths_off
from autoprec.io.paths import normalize_path, unwrap_model
from autoprec.lower.wide16 import scoring_gemms
from autoprec.probe import cache
from autoprec.probe import e2e as e2emod
from autoprec.probe.blockwise import shadow_batch
from autoprec.probe.grad_rules import GRAD_ERROR_LIMIT, GRAD_FLUSH_LIMIT, GRAD_NOTE_FROM
from autoprec.probe.grads import (
    SPLITS,
    GradProbes,
    GradStats,
    Projections,
    edge_grads,
    random_projection,
)
from autoprec.probe.layers import ProbeLayer, select_layers
from autoprec.probe.ranges import TensorRange
from autoprec.probe.rows import build_row, judge
from autoprec.probe.shadow import LocalStats, ShadowPass
from autoprec.probe.stages import Stages
from autoprec.probe.table import ProbeRow, SensitivityTable
from autoprec.stream.streamed import StreamedModel, stream_of
from autoprec.trace.graph import LayerGraph
from autoprec.workload.loading import ModelSpec, collect_batches, default_forward
from autoprec.workload.metrics import batch_size_of, detach_floats
from autoprec.workload.scoring import Reference

Forward = Callable[[nn.Module, Any], Any]


@dataclass(frozen=True)
class ProbeSettings:
    """What one probe run was asked for, validated (``probe``'s arguments, documented there)."""

    precisions: tuple[str, ...]  # canonical order, fp32 dropped
    forward: Forward  # model.py's forward, or the default
    loss: Callable[[Any, Any], torch.Tensor] | None
    metric: Callable[[Any, Any], float] | None
    e2e: str | Sequence[Any]
    layers: Sequence[str] | None  # normalised module paths; None: every GEMM layer
    budget: float
    progress: bool
    fp8_backend: str
    loss_scale: float
    probes: int
    seed: int
    e2e_limit: int
    underflow_limit: float
    split: str

    @property
    def units(self) -> str:
        """What ``e2e_error`` and the budget measure."""
        return "metric_drop" if self.metric is not None else "error"


def resolve_precisions(precisions: Iterable[str] | None, model: nn.Module) -> tuple[str, ...]:
    """Canonical order, fp32 (the reference) dropped; None: every one this device runs."""
    if precisions is None:
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        wanted = set(runnable_precisions(dev))
    else:
        wanted = {check_precision(p, "precisions") for p in precisions}
    out = tuple(p for p in PRECISIONS if p in wanted and p != "fp32")
    if not out:
        raise InputError("precisions: nothing to probe besides fp32 (the reference)")
    return out


def probe(
    model: nn.Module,
    batches: Iterable[Any],
    precisions: Iterable[str] | None = None,
    *,
    forward: Forward | None = None,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    metric: Callable[[Any, Any], float] | None = None,
    e2e: str | Sequence[Any] = "auto",
    layers: Sequence[str] | None = None,
    graph: LayerGraph | None = None,
    budget: float | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    fp8_backend: str = "emulated",
    loss_scale: float = 2.0**16,
    probes: int = 1,
    seed: int = 0,
    e2e_limit: int = 8,
    underflow_limit: float = 0.1,
    split: str = "sample",
) -> SensitivityTable:
    """Measure how sensitive each GEMM layer of ``model`` is to each precision.

    Args:
        batches: calibration batches (as model.py's ``calibration_data()`` yields them).
        precisions: to probe; default every precision this device runs (fp32 excluded).
        forward / loss / metric: model.py's functions (default forward: ``model(batch)``
            / ``(*batch)`` / ``(**batch)``). ``loss`` adds gradient probes and the loss
            effect; ``metric`` makes ``e2e_error`` a metric drop.
        e2e: end-to-end runs (only one layer lowered): "auto" (where the cheap estimate is
            within 2x of the budget, closest first, at most ``e2e_limit``), "all", "none",
            or a list of layer paths / (layer, precision) pairs.
        layers: probe only these module paths (default: every GEMM layer of the graph).
        graph: the model's LayerGraph if already traced (default: traced here).
        budget: in the budget's units (output error; metric drop with ``metric``);
            default 0.01. Used for "auto" and the reasons, never to exclude a pair.
        cache_dir: reuse / store the table keyed by model, weights, data, options, versions.
        probes: random projections (backwards) per batch for the cheap estimate.
        split: how the estimate's dot products are grouped ("sample", "row", "element";
            grads.py); "sample" is unbiased for models whose samples do not interact.
        underflow_limit: share of values below the smallest normal that excludes a pair.

    The model runs in eval mode (restored after); its weights, gradients and forwards are
    left as they were. A torch.compile / DDP wrapper is probed through the model it wraps.
    """
    # Probe the eager model: hooks and shadow re-runs belong outside torch.compile / DDP.
    model = unwrap_model(model)
    if layers is not None:
        layers = [normalize_path(p) for p in layers]
    # a list, a generator, a DataLoader: read once, checked as model.py's data is
    batches = collect_batches(batches, "probe", "calibration", verb="is")
    if probes < 1:
        raise InputError(f"probes: must be >= 1, got {probes}")
    if split not in SPLITS:
        raise InputError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    precs = resolve_precisions(precisions, model)
    fwd = forward or default_forward
    budget = 0.01 if budget is None else float(budget)
    options = {
        "precisions": precs, "e2e": e2e if isinstance(e2e, str) else [list(x) if
        isinstance(x, (tuple, list)) else x for x in e2e], "layers": list(layers or []),
        "budget": budget, "fp8_backend": fp8_backend, "loss_scale": loss_scale,
        "probes": probes, "seed": seed, "e2e_limit": e2e_limit,
        "underflow_limit": underflow_limit, "split": split, "forward": cache.function_hash(forward),
        "loss": cache.function_hash(loss), "metric": cache.function_hash(metric),
        # the rows are cached judged: a change of the gradient rule is a new key
        "grad_rule": [2, GRAD_FLUSH_LIMIT, GRAD_ERROR_LIMIT, GRAD_NOTE_FROM],
    }
    settings = ProbeSettings(
        precisions=precs, forward=fwd, loss=loss, metric=metric, e2e=e2e, layers=layers,
        budget=budget, progress=progress, fp8_backend=fp8_backend, loss_scale=loss_scale,
        probes=probes, seed=seed, e2e_limit=e2e_limit, underflow_limit=underflow_limit,
        split=split)
    key = ""
    if cache_dir is not None:
        key = cache.cache_key(model, batches, options)
        hit = cache.load(cache_dir, key)
        if hit is not None:
            hit.meta["cached"] = True
            return hit

    started = time.monotonic()
    flags = {m: m.training for m in model.modules()}
    model.eval()  # dropout would make the shadow re-runs differ from the fp32 pass
    # a streamed model's stages take minutes: kept as they finish (probe/stages.py)
    stages = (Stages(cache_dir, key, STAGE_CLASSES)
              if cache_dir is not None and getattr(model, "autoprec_stream", None) is not None
              else None)
    try:
        with scoring_gemms():  # 16-bit GEMMs this CPU has no kernel for: lower/wide16
            table = _probe(model, batches, graph, settings, stages)
    finally:
        for m, flag in flags.items():
            m.training = flag
    table.meta.update(seconds=round(time.monotonic() - started, 3), cache_key=key,
                      cached=False, options=options)
    if cache_dir is not None:
        cache.store(cache_dir, key, table)
    if stages is not None:
        stages.clear()
    return table


@dataclass
class ShadowResults:
    """What the fp32 pass with shadow hooks gathered over the calibration data."""

    local: dict[tuple[str, str], LocalStats]  # (layer, precision) -> local error
    ranges: dict[str, dict[str, TensorRange]]  # layer -> tensor class -> range
    projections: Projections  # the cheap end-to-end estimate's sums
    grads: GradProbes | None  # with a loss: the gradient probes
    sq_y: float  # Σ‖y_ref‖² over the finite outputs
    reference: Reference  # the fp32 outputs (and metric) the end-to-end runs compare with


#: what the stage files hold (probe/stages.py), the classes allowed when they are read
STAGE_CLASSES = (ShadowResults, LocalStats, TensorRange, Projections, GradProbes, GradStats,
                 Reference)


def _probe(model: nn.Module, batches: list[Any], graph: LayerGraph | None,
           settings: ProbeSettings, stages: Stages | None = None) -> SensitivityTable:
    """The stages: layers -> shadow pass -> rows -> end-to-end runs -> the table.
    ``stages``: where the shadow pass and each end-to-end run are kept as they finish and
    read back from (a killed streamed probe resumes)."""
    if graph is None:
        from autoprec.trace import trace

        graph = trace(model, batches[0], forward=settings.forward, tracers=("hooks",))
    sel = select_layers(model, graph, settings.precisions, settings.layers)
    shadow = stages.load("shadow") if stages is not None else None
    if shadow is None:
        shadow = _shadow_pass(model, batches, sel, settings)
        if stages is not None:
            stages.store("shadow", shadow)
    rows = _rows(sel, shadow, settings)
    todo = _end_to_end(model, batches, sel, rows, shadow, settings, stages)
    return SensitivityTable(rows, _meta(graph, sel, len(batches), len(todo), settings))


def _shadow_pass(model: nn.Module, batches: list[Any], sel: list[ProbeLayer],
                 settings: ProbeSettings) -> ShadowResults:
    """One fp32 pass: every layer's shadow computations and ranges, the reference outputs,
    the projections' backwards and, with a loss, the gradient probes."""
    loss, metric, probes = settings.loss, settings.metric, settings.probes
    proj = Projections()
    gprobes = GradProbes(settings.loss_scale, settings.fp8_backend) if loss is not None else None
    gen = torch.Generator().manual_seed(settings.seed)
    ref_outputs: list[list[torch.Tensor]] = []
    sq_y, metric_sum, metric_w = 0.0, 0.0, 0.0  # python floats: no tensor keeps a graph
    bar = tqdm(batches, desc="probe: shadow pass", unit="batch", disable=not settings.progress,
               leave=False)
    stream = stream_of(model)
    blockwise = stream is not None and len(stream.blocks) > 1

    def scalars_of(out: Any, batch: Any) -> list[torch.Tensor | None]:
        """The scalars differentiated: each projection, then the loss (None: no gradient)."""
        scalars = [random_projection(out, gen) for _ in range(probes)]
        if gprobes is not None:
            lval = loss(out, batch)  # type: ignore[misc]
            ok = isinstance(lval, torch.Tensor) and lval.requires_grad
            scalars.append(lval if ok else None)
        return scalars

    def consume(calls: list[Any], grads: list[Any]) -> None:
        for g in grads[:probes]:
            if g is not None:
                proj.add(calls, g, 1.0 / probes)
        if gprobes is not None and grads[probes] is not None:
            gprobes.add(calls, grads[probes])

    with ShadowPass(model, sel, settings.fp8_backend, track=True,
                    keep_inputs=loss is not None) as sp:
        for batch in bar:
            out = None
            if blockwise:  # streamed: backward a block at a time (probe/blockwise.py)
                assert stream is not None
                out = shadow_batch(stream, sp, lambda b=batch: settings.forward(model, b),
                                   lambda o, b=batch: scalars_of(o, b), consume,
                                   weights=gprobes is not None)
                blockwise = out is not None
            whole = out is None
            if whole:
                with torch.enable_grad():
                    out = settings.forward(model, batch)
            calls = sp.take_calls()
            floats = detach_floats(out)
            ref_outputs.append(floats)
            sq_y += sum(float(t.pow(2).sum()) for t in floats if torch.isfinite(t).all())
            if metric is not None:
                with torch.no_grad(), fused_paths_off():
                    value = float(metric(out, batch))
                w = float(batch_size_of(batch) or 1)
                metric_sum, metric_w = metric_sum + w * value, metric_w + w
            if whole:
                sp.busy = True  # the gradient probes call layers whose children are hooked
                try:
                    for _ in range(probes):
                        s = random_projection(out, gen)
                        if s is not None:
                            proj.add(calls, edge_grads(s, calls, retain=True), 1.0 / probes)
                    if gprobes is not None:
                        lval = loss(out, batch)
                        if isinstance(lval, torch.Tensor) and lval.requires_grad:
                            gprobes.add(calls, edge_grads(lval, calls, retain=False))
                finally:
                    sp.busy = False
            # the projection ``s`` and the loss are scalars *with* this batch's graph: drop
            # them with the outputs, or the graph lives through the next batch's forward
            s = lval = None
            del out, calls, s, lval
    bar.close()
    ref_metric = None
    if metric is not None:
        ref_metric = metric_sum / metric_w if metric_w else 0.0
    return ShadowResults(local=sp.local, ranges=sp.ranges, projections=proj, grads=gprobes,
                         sq_y=sq_y, reference=Reference(ref_outputs, ref_metric, len(batches)))


def _rows(sel: list[ProbeLayer], shadow: ShadowResults,
          settings: ProbeSettings) -> list[ProbeRow]:
    """One row per (layer, precision): the estimates, the hard facts, the reasons."""
    proj, split = shadow.projections, settings.split
    rows: list[ProbeRow] = []
    for lay in sel:
        for p in settings.precisions:
            if p not in lay.precisions and p not in lay.disallowed:
                continue  # the layer as given, or above it (a 16-bit layer): no row
            key = (lay.path, p)
            local = shadow.local.get(key)
            if key in proj.seen and shadow.sq_y > 0:
                est, method = math.sqrt(proj.sq[split][key] / shadow.sq_y), "jacobian"
            else:
                est, method = (local.error if local else math.nan), "local"
            gst = shadow.grads.stats.get(key) if shadow.grads is not None else None
            rows.append(build_row(lay, p, local, shadow.ranges[lay.path], est, method, gst))
    for r in rows:
        judge(r, shadow.ranges[r.layer], settings.budget, settings.units,
              settings.underflow_limit, settings.loss_scale)
    return rows


def _end_to_end(model: nn.Module, batches: list[Any], sel: list[ProbeLayer],
                rows: list[ProbeRow], shadow: ShadowResults,
                settings: ProbeSettings, stages: Stages | None = None
                ) -> list[tuple[str, str]]:
    """Run the chosen (layer, precision) pairs end to end, only that layer lowered; the
    rows get their end-to-end errors and are judged again. Returns the pairs run (a run
    kept in ``stages`` is read back, not run again)."""
    by_key = {(r.layer, r.precision): r for r in rows}
    estimates = {k: r.cheap_estimate for k, r in by_key.items()}
    hard = {k for k, r in by_key.items() if r.hard}
    metric, budget = settings.metric, settings.budget
    todo = e2emod.choose(settings.e2e, sel, estimates, hard, budget, metric is not None,
                         settings.e2e_limit)
    if not todo:
        return todo
    spec = ModelSpec(path=None, name=type(model).__name__, build_model=lambda: model,
                     calibration_data=lambda: batches, forward=settings.forward, metric=metric)
    by_path = {lay.path: lay for lay in sel}
    kept = stages.load("e2e") if stages is not None else None
    done: dict[tuple[str, str], tuple[float, float]] = {
        (a, b): (err, val) for a, b, err, val in (kept or [])}
    stream = stream_of(model)
    order = todo if stream is None else sorted(todo, key=lambda k: -_block(stream, k[0]))
    for path, p in tqdm(order, desc="probe: end-to-end", unit="run", disable=not settings.progress,
                        leave=False):
        if (path, p) not in done:
            # streamed: the blocks before the layer's are the model as given in every run;
            # the deepest layer's run first keeps them for the others (stream: "Replay")
            with (stream.replaying("as given", _block(stream, path)) if stream is not None
                  else contextlib.nullcontext()):
                sc = e2emod.measure(spec, model, batches, shadow.reference, by_path[path], p,
                                    settings.fp8_backend)
            done[(path, p)] = (sc.error, sc.value)
            if stages is not None:
                stages.store("e2e", [[a, b, err, val] for (a, b), (err, val) in done.items()])
        r = by_key[(path, p)]
        r.e2e_output_error, r.e2e_error = done[(path, p)]
        judge(r, shadow.ranges[path], budget, settings.units, settings.underflow_limit,
              settings.loss_scale)
    return todo


def _block(stream: StreamedModel, path: str) -> int:
    """The block a probed layer is in; 0 for one outside the blocks."""
    i = stream.block_of(path)
    return 0 if i is None else i


def _meta(graph: LayerGraph, sel: list[ProbeLayer], n_batches: int, e2e_runs: int,
          settings: ProbeSettings) -> dict[str, Any]:
    """The table's meta: what was probed and its cost in forward-pass equivalents."""
    precs = settings.precisions
    n_pairs = sum(len(lay.precisions) for lay in sel)
    with_loss = settings.loss is not None
    cost = {
        "fp32_pass": 1.0,
        "shadow": float(len(precs)),
        "estimate_backward": 2.0 * settings.probes,
        "loss_backward": 2.0 if with_loss else 0.0,
        "grad_probes": 3.0 * (len(precs) + 1 + ("fp16" in precs)) if with_loss else 0.0,
        "e2e_runs": float(e2e_runs),
    }
    return {
        "fingerprint": graph.fingerprint, "precisions": list(precs), "budget": settings.budget,
        "units": settings.units, "batches": n_batches, "layers": len(sel), "pairs": n_pairs,
        "e2e_runs": e2e_runs, "cost": cost,
        # layers stored in 16 bits: their own precision is the reference (estimate 0)
        "own": {lay.path: lay.own for lay in sel if lay.own != "fp32"},
        "cost_total": sum(cost.values()), "cost_naive": float(n_pairs + 1),
        "versions": {"autoprec": _version(), "torch": torch.__version__},
    }


def _version() -> str:
    from autoprec._version import __version__

    return __version__
