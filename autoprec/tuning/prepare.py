"""tune's stages 1 and 2: the model prepared, and the space of plans it spans.

    prepare  load the model and data, the up-front memory check, the references (the
             model's own outputs, as given: fp32, bf16, fp16 or mixed), trace (graph + op
             trace), probes, the cost model at the deployment batch size
    space    the default region and one variable per GEMM layer, narrowed by hard facts
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from autoprec.cost import CostModel
from autoprec.errors import InputError, warn
from autoprec.formats.gemm import is_forward_only
from autoprec.formats.precisions import PRECISIONS
from autoprec.io.paths import check_out_path
from autoprec.io.validate import check_out_not_input
from autoprec.pricing.speed_source import calibration_dir
from autoprec.pricing.target import Target, resolve_target
from autoprec.probe import probe
from autoprec.search.space import REGIONS, Key, SearchSpace, build_space
from autoprec.stream.progress import block_progress
from autoprec.trace import trace
from autoprec.trace.graph import LayerGraph
from autoprec.tuning.config import TuneConfig
from autoprec.tuning.memory import StagePeaks, check_fits, reset_peak
from autoprec.workload.checkpoint_spec import load_model
from autoprec.workload.loading import ModelSpec
from autoprec.workload.metrics import batch_size_of
from autoprec.workload.reference import ModelReference, model_reference, offered, own_precision
from autoprec.workload.scoring import Reference, batch_tensors, reference, same_tensors, score

# -- stage 1: prepare ---------------------------------------------------------------------

#: Two runs of the model as given may differ by this fraction of the budget (CPU GEMM
#: kernels may round differently run to run: 7e-6 seen on a 1 % budget): orders of
#: magnitude below anything a decision rests on. More is refused as not deterministic.
NOISE_FRACTION = 1e-3


@dataclass
class Prepared:
    """The model, its data and references, its graph, the probes and the cost model."""

    spec: ModelSpec
    net: torch.nn.Module
    calib: list[Any]
    eval_batches: list[Any]
    ref: Reference
    eval_ref: Reference
    same_data: bool
    graph: LayerGraph
    table: Any  # SensitivityTable
    cost: CostModel
    deploy_bs: int
    calib_bs: int
    out_path: Path
    #: the one target of the tune (name, mode, form, fp8 backend, speed source: where the
    #: speed figures come from, measured here or not)
    target: Target
    reference: ModelReference = field(default_factory=ModelReference)  # the model as given


def prepare(model: str | Path | ModelSpec, cfg: TuneConfig, profile: Any = None,
            peaks: StagePeaks | None = None) -> Prepared:
    # a checkpoint folder tuned for training is held in fp32 (the trainer's masters)
    spec = (model if isinstance(model, ModelSpec)
            else load_model(model, masters=cfg.train_check.train_aware
                            or cfg.pricing.form == "train"))
    if cfg.budget.use_metric and spec.metric is None:
        raise InputError(f"{spec.where}: --max-drop needs a metric(outputs, batch) in model.py")
    if cfg.train_check.train_aware and spec.loss is None:
        raise InputError(f"{spec.where}: --train-aware needs loss(outputs, batch) in model.py")
    out_path = cfg.output.out or Path("policies") / f"{spec.name}-{cfg.pricing.target}.yaml"
    check_out_path(out_path)  # before any expensive work
    check_out_not_input(out_path, model=spec.path, storage=cfg.study.storage)
    net = spec.model()
    refm = model_reference(net)
    check_fits(net, spec.where, cfg.pricing.memory_limit)  # the model twice, or one line now
    reset_peak(net)
    peaks = peaks if peaks is not None else StagePeaks()
    peaks.model = net
    if not refm.is_fp32 and (cfg.train_check.train_aware or cfg.pricing.form == "train"):
        what = "--train-aware" if cfg.train_check.train_aware else "--form train"
        raise InputError(f"{spec.where}: {what} runs autocast over fp32 master weights, but "
                         f"the model is {refm.label()}; tune it in the deploy form (the "
                         "default), or load it in fp32 to train it")
    calib = spec.calibration_batches()
    eval_batches = spec.eval_batches()
    same_data = spec.eval_data is None
    before = batch_tensors(calib[0])  # to tell an input changed in place from randomness
    with peaks.stage("reference"), block_progress(net, "reference", cfg.output.progress):
        ref, eval_ref, check = _references(spec, net, calib, eval_batches, same_data, cfg)
    if check.error != 0.0:
        if not same_tensors(before, batch_tensors(calib[0])):
            raise InputError(f"{spec.where}: forward() changes its input in place (batch 0 of "
                             "calibration_data differs after one forward, e.g. x.mul_()); "
                             "autoprec runs every batch many times: compute on a copy "
                             "(x = x * 2, or x.clone())")
        noise = NOISE_FRACTION * cfg.budget.value
        if not check.error <= noise:  # NaN too
            raise InputError(
                f"{spec.where}: the {refm.label()} model is not deterministic (two runs "
                f"differ by {check.error:.3g}, more than {NOISE_FRACTION:g} x the budget "
                f"{cfg.budget.value:g}, enough to change a decision); put it in eval mode / fix "
                "random ops")
        warn(f"{spec.where}: the {refm.label()} model's two runs differ by "
             f"{check.error:.3g} ({check.error / cfg.budget.value:.2g} of the budget "
             f"{cfg.budget.value:g}; kernels that round differently run to run): accepted as "
             "noise, every error measured includes it")
    cache = cfg.output.cache_dir or out_path.parent / ".autoprec" / "probe-cache"
    with peaks.stage("trace"), block_progress(net, "trace", cfg.output.progress):
        graph = _traced(net, spec, calib[0], cache)
    unknown = [lk for lk in cfg.search.locked if lk not in graph]
    if unknown:
        raise InputError(f"--lock {unknown[0]!r}: {spec.where} has no such module")
    # Gradient probes (model.py's loss) cost ~20 forward-equivalents; only training needs
    # them: a train-form tune with a loss excludes the pairs whose gradients flush
    # (probe/grad_rules.py) before anything trains.
    with peaks.stage("probe"), block_progress(net, "probe", cfg.output.progress):
        table = probe(net, calib, precisions=[p for p in cfg.search.precisions if p != "fp32"],
                      forward=spec.forward, loss=spec.loss if cfg.pricing.form == "train" else None,
                      metric=spec.metric if cfg.budget.use_metric else None, graph=graph,
                      budget=cfg.budget.value, cache_dir=cache, progress=cfg.output.progress)
    calib_bs = batch_size_of(calib[0]) or 1
    target = resolve_target(cfg.pricing.target, compile=cfg.pricing.compile, form=cfg.pricing.form,
                            batch_size=cfg.pricing.batch_size, measure=cfg.pricing.measure,
                            cache_dir=calibration_dir(out_path, cfg.output.cache_dir))
    deploy_bs = target.deploy_batch(calib[0])
    # the one price of a target (Target.plan_cost, as eval and check price): on a local CPU
    # the model's own ops timed here, a training step's loss included; an explicit profile
    # (tests, experiments) prices by it alone
    cost = target.plan_cost(graph, deploy_bs, net=net, forward=spec.forward, loss=spec.loss,
                            batch=calib[0], profile=profile)
    if cfg.pricing.fuse_groups == "auto":  # priced as a fused runtime runs it
        cost.shared_quant_inputs = True
    if cfg.pricing.max_weight_mb is not None:  # a plan over it cannot deploy: priced as infeasible
        cost.max_weight_bytes = cfg.pricing.max_weight_mb * 1e6
    if cfg.pricing.memory_limit_gb is not None and hasattr(cost, "max_train_bytes"):
        cost.max_train_bytes = cfg.pricing.memory_limit_gb * 1e9  # a step over it cannot train
    if not cfg.budget.use_metric and spec.metric is not None:
        spec = replace(spec, metric=None)  # the budget is on relative L2: score that
    return Prepared(spec, net, calib, eval_batches, ref, eval_ref, same_data, graph, table,
                    cost, deploy_bs, calib_bs, out_path, target, refm)


def _traced(net: Any, spec: ModelSpec, batch: Any, cache_dir: Path) -> LayerGraph:
    """The layer graph (``trace``); a streamed model's is kept in ``cache_dir`` under the
    probe cache's kind of key (structure, weights, the batch, the forward's code, the
    versions) and read back by the next tune of it (``probe.stages``)."""
    if getattr(net, "autoprec_stream", None) is None:
        return trace(net, batch, forward=spec.forward, model_name=spec.name)
    from autoprec.probe import cache
    from autoprec.probe.stages import Stages
    from autoprec.trace.graph import LayerNode
    from autoprec.trace.ops import Call, Op, OpTrace, Value

    key = cache.cache_key(net, [batch], {"stage": "trace", "name": spec.name,
                                         "forward": cache.function_hash(spec.forward)})
    kept = Stages(cache_dir, key, (LayerGraph, LayerNode, OpTrace, Value, Op, Call),
                  prefix="trace")
    graph = kept.load("graph")
    if isinstance(graph, LayerGraph):
        return graph
    graph = trace(net, batch, forward=spec.forward, model_name=spec.name)
    kept.store("graph", graph)
    return graph


def _references(spec: ModelSpec, net: Any, calib: list[Any], eval_batches: list[Any],
                same_data: bool, cfg: TuneConfig) -> tuple[Any, Any, Any]:
    """The model's own outputs on both sets, and a second run of it (determinism)."""
    ref = reference(spec, net, calib, "of calibration_data",  # also: the model accepts it
                    need_outputs=not cfg.budget.use_metric)
    eval_ref = ref if same_data else reference(spec, net, eval_batches, "of eval_data")
    check = score(spec, net, calib, ref, "of calibration_data")
    return ref, eval_ref, check



# -- stage 2: the space -------------------------------------------------------------------

def make_space(prep: Prepared, cfg: TuneConfig) -> SearchSpace:
    """Choices per GEMM layer: graph eligibility ∩ target device ∩ probes' hard facts ∩
    what the layer's own precision offers (``reference.offered``: a bf16 layer takes bf16,
    fp16, the GEMM formats and an fp32 island, never tf32); the default region's: the
    regions the target runs among the precisions asked for, offered by the model's own."""
    profile = prep.cost.profile
    device_why = {p: profile.supports(p)[1] for p in PRECISIONS if not profile.supports(p)[0]}
    hard = prep.table.hard_excluded() if prep.table is not None else {}
    modules = dict(prep.net.named_modules())
    layers, allowed, excluded = [], {}, {}
    for node in prep.graph.gemm_nodes:
        if not node.is_leaf and node.kind not in ("attention", "matmul"):
            continue
        layers.append(node.path)
        # above the layer's own precision: not a choice, and (like the target's gaps) no
        # reason to list on every layer (the policy's `reference:` says it once)
        mod = modules.get(node.path)
        own = offered(own_precision(mod), PRECISIONS) if mod is not None else PRECISIONS
        why_not = {p: r for p, r in node.disallowed.items()
                   if p in cfg.search.precisions and p not in device_why}
        for p in cfg.search.precisions:  # the target's own gaps are no layer's reason: not listed
            if is_forward_only(p) and cfg.train_check.train_aware:
                why_not.setdefault(p, f"{p}: forward-only (no gradient recipe): not for "
                                      "--train-aware")
            if (node.path, p) in hard:
                why_not.setdefault(p, hard[(node.path, p)])
        allowed[node.path] = [p for p in node.allowed if p in cfg.search.precisions and p in own
                              and p not in why_not and p not in device_why]
        excluded[node.path] = why_not
    if not layers:
        raise InputError(
            f"nothing to tune: {prep.spec.where} has no GEMM layer (Linear, Conv, matmul, "
            "attention) whose precision autoprec can choose; its forward is priced at "
            f"{prep.cost.fp32_time * 1e6:.3g} µs in fp32 on {cfg.pricing.target}")
    regions = [p for p in REGIONS if p in cfg.search.precisions and p not in device_why
               and p in offered(prep.reference.default, PRECISIONS)]
    space = build_space(layers, allowed, excluded, cfg.search.precisions, locked=cfg.search.locked,
                        regions=regions, fused=fused_layer_groups(prep, cfg, layers))
    if not any(len(v.choices) > 1 for v in space.all_variables):
        why = sorted({w for v in space.variables for w in v.excluded.values()}
                     | {device_why[p] for p in cfg.search.precisions if p in device_why})
        lower = ", ".join(p for p in cfg.search.precisions if p != "fp32")
        raise InputError(
            f"nothing to tune: no layer of {prep.spec.name} may take "
            f"{lower or 'a precision below fp32'} on {cfg.pricing.target}"
            + (f" ({'; '.join(why)[:300]})" if why else ""))
    return space


def fused_layer_groups(prep: Prepared, cfg: TuneConfig, layers: list[str]
                       ) -> list[list[str]]:
    """With ``--fuse-groups auto``: the model's fused groups (``trace.fused_groups``, by
    names and by one forward on the first calibration batch), members among ``layers``."""
    if cfg.pricing.fuse_groups != "auto":
        return []
    from autoprec.trace.fused_groups import fused_groups

    known = set(layers)
    groups = fused_groups(prep.net, lambda: prep.spec.run(prep.net, prep.calib[0], 0))
    return [ms for g in groups if len(ms := [m for m in g.members if m in known]) >= 2]


def reference_key(space: SearchSpace, refm: ModelReference) -> Key | None:
    """The plan key that runs the model as given (error 0: it changes no tensor), or None
    when no key does (a module kept in fp32 that is no GEMM layer: the region covers it).
    None for an fp32 model: the evaluator's default, the all-fp32 plan, is that one."""
    if refm.is_fp32 or refm.islands:
        # a mixed model's fp32 modules often cast their own inputs and outputs (T5's `wo`):
        # the deploy form's fp32 rule on them changes what they hand on, so its error is
        # measured like any plan's, not assumed 0
        return None
    key = [PRECISIONS.index(refm.default)]
    for v in space.variables:
        want = {refm.islands.get(lay, refm.default) for lay in v.layers}
        if len(want) != 1 or (p := want.pop()) not in v.choices:
            return None
        key.append(PRECISIONS.index(p))
    if refm.default not in space.region.choices:
        return None
    return tuple(key)


__all__ = ["NOISE_FRACTION", "Prepared", "make_space", "prepare", "reference_key"]
