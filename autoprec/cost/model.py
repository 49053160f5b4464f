"""Whole-forward roofline cost of an execution plan: every op the applied model runs.

The graph's op trace (``autoprec.trace.ops``: one recorded forward) is replayed under the
plan (``autoprec.plan.schedule``: the dtype of every tensor, every cast), and every kernel
of the replay is priced on the target profile:

    time = max(FLOPs / (peak(precision) x eff), bytes / bandwidth) + launch (+ GEMM set-up)

- GEMMs and SDPA at the precision they compute in (fp8 for an fp8 leaf, tf32 in a tf32
  region), reading their operands in the dtype they are read in and writing their output;
  SDPA is one fused kernel (q, k, v, mask in; output out), as on a CUDA target;
- every other op (norms, softmax, activations, residual adds, copies, the model's own
  explicit casts where they change the dtype) as memory-bound: the bytes of its inputs and
  outputs at the dtypes they carry; views cost nothing; an embedding reads the rows it
  gathers, not its table;
- every inserted cast (read + write, one launch): autocast's input casts — weights too,
  once per forward where the plan has one 16-bit dtype (autocast's cast cache), on every
  call where it has two — fp32 islands' input casts, 16-bit outputs cast back to fp32 when they return to a fp32 caller;
- fp8 current scaling per GEMM input: an amax pass (read), a scale kernel (launch only),
  the cast to e4m3 (read, write 1 byte); the GEMM reads 1-byte operands and writes the
  region's 16-bit dtype. Weights are quantised once per weight version (apply caches the
  e4m3 weight), not per forward.

Assumptions: eager PyTorch, one kernel per recorded op, one stream (kernels back to back),
no fusion. Activation terms scale by ``batch_size / graph.batch_size`` (values derived from
the model input); parameter bytes do not ("price at the deployment shape").

Measured op times (``op_times``, ``measure.op_times``: a local CPU target): where the model's
own op was timed here in the dtype a plan runs it in, that time replaces the roofline
term of the op (dispatch included, so no launch overhead is added); views cost their
dispatch; inserted casts their timed cast; every plan pays the recorded module calls'
host cost, and each call through one of apply's wrappers (``Schedule.wrapper_calls``) the
wrapper's. Ops without a timing keep the roofline.

This module holds the plan-level totals (``CostModel``: which plans can run, the fp32
reference, the breakdown per module, the weights a plan holds). A ``CostModel`` is
composed of a forward pricer — ``op_pricing.EagerPricer`` (the roofline above, with this
machine's ``OpTable`` where op times are given) or ``compiled.CompiledPricer`` (as
``torch.compile`` runs the forward) — and optionally a training-step part
(``step.StepPart``: backward, optimizer, GradScaler), which prices the step on top of
whichever forward pricer it is given. ``make_cost_model`` is the one factory.
The value types live in ``price_types`` (``Kernel``, ``Breakdown``, ``Priced``, ``PARTS``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autoprec.cost.compiled import CompiledPricer, convs_channels_last
from autoprec.cost.op_pricing import EagerPricer, ForwardPricer, OpTable, Roofline
from autoprec.cost.op_times_record import OpTimes
from autoprec.cost.price_types import PARTS, Breakdown, Kernel, Priced
from autoprec.cost.profiles import DeviceProfile
from autoprec.device.targets import device_type
from autoprec.errors import InputError
from autoprec.formats.precisions import BYTES, FORMS, GEMM_FORMATS, PRECISIONS, check_precision
from autoprec.plan.compile import CODE, ModuleTree, RuleSet
from autoprec.plan.schedule import Schedule, replay
from autoprec.policy.schema import MODES, Policy
from autoprec.trace.graph import LayerGraph

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.cost.step import StepPart
    from autoprec.cost.train_memory import TrainMemory

#: Bytes per element a module's tensors are stored in under the deploy form, by region
#: code (fp32, tf32, bf16, fp16; the GEMM-format codes never are a region), and a GEMM
#: format's bytes per element (scales included) by precision code (0: not a format).
_STORE_WIDTH = np.array([BYTES["fp32"], BYTES["tf32"], BYTES["bf16"], BYTES["fp16"],
                         *[4] * len(GEMM_FORMATS)], dtype=float)
_FORMAT_WIDTH = np.array([BYTES[p] if p in GEMM_FORMATS else 0.0 for p in PRECISIONS])


def device_type_of(profile: DeviceProfile) -> str:
    """Whose autocast lists apply: "cpu" for the cpu profile, "cuda" for the GPUs."""
    return device_type(profile.name)


class CostModel:
    """Estimated time of plans on ``profile`` at deployment ``batch_size``.

    ``estimate(policy)`` is the seconds of one forward (with ``step``: one training step)
    under the policy's plan (inf when the device lacks a precision it uses, or the plan
    cannot run); ``speedup`` is over the all-fp32 plan. ``price(rules, codes)`` prices many
    plans at once for the search.

    Composed of ``forward`` (a ``ForwardPricer``: ``EagerPricer`` by default,
    ``compiled.CompiledPricer`` with ``mode="compile"``) and ``step`` (a
    ``step.StepPart`` or None: the forward alone). ``mode``, ``horizontal``, ``frozen``
    and ``call_overhead_s`` choose and configure the forward pricer (see
    ``CompiledPricer``).
    """

    def __init__(self, graph: LayerGraph, profile: DeviceProfile,
                 batch_size: int | None = None, *, device_type: str | None = None,
                 form: str = "train", op_times: OpTimes | None = None,
                 mode: str = "eager", horizontal: bool | None = None, frozen: bool = False,
                 call_overhead_s: float | None = None, step: StepPart | None = None) -> None:
        if graph.ops is None:
            raise InputError("the layer graph has no op trace; build it with autoprec.trace_model()")
        if graph.batch_size < 1:
            raise InputError(f"graph.batch_size >= 1 must hold, but got {graph.batch_size}")
        if batch_size is None:
            batch_size = graph.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"--batch-size must be a positive integer, but got {batch_size!r}")
        if form not in FORMS:
            raise InputError(f"form must be one of {', '.join(FORMS)}, but got {form!r}")
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, but got {mode!r}")
        if step is not None:
            form = "train"  # a step trains: fp32 masters
        self.form = form  # the form code rows are priced in (a Policy carries its own)
        self.graph = graph
        self.trace = graph.ops
        self.profile = profile
        self.batch_size = batch_size
        self.scale = batch_size / graph.batch_size
        self.device_type = device_type or device_type_of(profile)
        self.tree = ModuleTree.from_graph(graph)
        self._params = self._param_table()
        self.max_weight_bytes: float | None = None  # a plan holding more cannot deploy
        self._rulesets: dict[tuple[str, ...], RuleSet] = {}
        if op_times is not None and op_times.batch_size != batch_size:
            raise ValueError(f"op times measured at batch {op_times.batch_size}, priced at "
                             f"{batch_size}")
        self.op_times = op_times
        self.mode = mode
        self.step = step.bound(graph, self.device_type) if step is not None else None
        #: replay the forward as a training step runs it: autoprec's weight-cast cache off
        self.grad_mode = step is not None
        roofline = Roofline.of(self.trace, self.tree, profile, self.scale)
        if mode == "compile":
            table = OpTable(self.trace, op_times, self.scale,
                            channels_last=convs_channels_last())
            self.forward: ForwardPricer = CompiledPricer(
                roofline, table, horizontal=(device_type_of(profile) == "cpu" if horizontal is None
                                             else horizontal),
                frozen=frozen, call_overhead_s=(profile.call_overhead_s
                                                if call_overhead_s is None else call_overhead_s))
        else:
            self.forward = EagerPricer(roofline, OpTable(self.trace, op_times, self.scale))
        self._fp32, self._given = self._reference_times()

    @property
    def shared_quant_inputs(self) -> bool:
        """A fused runtime quantises an activation read by several GEMM-format leaves in
        one format once (``EagerPricer.shared_quant_inputs``)."""
        return self.forward.shared_quant_inputs

    @shared_quant_inputs.setter
    def shared_quant_inputs(self, value: bool) -> None:
        self.forward.shared_quant_inputs = value

    @property
    def max_train_bytes(self) -> float | None:
        """A plan whose training step holds more bytes cannot run (``--memory-limit``;
        None: no limit, or not priced as a step)."""
        return self.step.max_train_bytes if self.step is not None else None

    @max_train_bytes.setter
    def max_train_bytes(self, value: float | None) -> None:
        if self.step is not None:
            self.step.max_train_bytes = value

    def _reference_times(self) -> tuple[float, float]:
        """(all-fp32, the model as given) seconds. All-fp32 is the reference every speed-up
        divides, the fp32 row tune and eval time: for an fp32 model the training form's
        (whatever form this model prices in) — which is also the model as given. A 16-bit
        model's fp32 is its weights upcast as ``model.float()`` does, the deploy form's
        fp32: the training form keeps the weights it is given, so its "fp32" is the 16-bit
        model itself (est_speedup over fp32 once equalled the speed-up over the model)."""
        fp32_code = np.array([[CODE["fp32"]]])
        as_given = float(self.price(self.rules(()), fp32_code, "train").time[0])
        sixteen = any(v.source == "param" and v.dtype in ("bf16", "fp16")
                      for v in self.trace.values)
        if not sixteen:
            return as_given, as_given
        return float(self.price(self.rules(()), fp32_code, "deploy").time[0]), as_given

    def with_profile(self, profile: DeviceProfile) -> CostModel:
        """The same trace, forward pricer and step priced on another (e.g. calibrated)
        profile."""
        new = copy.copy(self)
        new.profile = profile
        new.forward = copy.copy(self.forward)
        new.forward.roofline = self.forward.roofline.for_profile(profile)
        new._fp32, new._given = new._reference_times()
        return new

    def with_step(self, step: StepPart | None) -> CostModel:
        """The same trace, profile, batch, op timings and forward pricer, pricing the
        training step ``step`` (None: the forward alone)."""
        f = self.forward
        kw = ({"mode": "compile", "horizontal": f.horizontal, "frozen": f.frozen,  # type: ignore[attr-defined]
               "call_overhead_s": f.call_overhead_s} if self.mode == "compile" else {})  # type: ignore[attr-defined]
        new = CostModel(self.graph, self.profile, self.batch_size, device_type=self.device_type,
                        form=self.form, op_times=self.op_times, step=step, **kw)
        new.shared_quant_inputs = self.shared_quant_inputs
        new.max_weight_bytes = self.max_weight_bytes
        return new

    # -- plans ---------------------------------------------------------------------------------
    def rules(self, paths: Sequence[str]) -> RuleSet:
        """The RuleSet for these rule paths (cached)."""
        key = tuple(paths)
        rs = self._rulesets.get(key)
        if rs is None:
            try:
                rs = self._rulesets[key] = RuleSet(self.tree, key)
            except KeyError as err:
                raise InputError(f"{self.graph.model_name or 'the model'} has no module "
                                 f"{err.args[0]!r}") from None
        return rs

    def _form(self, policy: Policy | Mapping[str, str]) -> str:
        return policy.form if isinstance(policy, Policy) else self.form

    def row(self, policy: Policy | Mapping[str, str], default: str = "fp32"
            ) -> tuple[RuleSet, np.ndarray]:
        """The RuleSet and the (1, K) code row of one plan (validated)."""
        return self._row(policy, default)

    def _row(self, policy: Policy | Mapping[str, str], default: str) -> tuple[RuleSet, np.ndarray]:
        if isinstance(policy, Policy):
            layers, default = dict(policy.layers), policy.default
        else:
            layers = dict(policy)
        check_precision(default, "default")
        for p, prec in layers.items():
            check_precision(prec, f"layer {p!r}")
        rs = self.rules(list(layers))
        return rs, rs.codes_of(default, layers)[None, :]

    def price(self, rules: RuleSet, codes: np.ndarray, form: str | None = None) -> Priced:
        """Price T plans: ``codes`` (T, K) code rows of ``rules`` (see plan.compile), in
        ``form`` (default: the model's ``form``)."""
        region, prec, wrapped = rules.encode(codes)
        sch = replay(self.trace, region, prec, wrapped, self.device_type,
                     form or self.form, grad=self.grad_mode)
        parts = self.forward.price(sch)
        time = parts.sum(axis=1)
        reasons = dict(sch.reasons)
        # a precision the device lacks, used by a module that runs
        r = self.forward.roofline
        used = np.where(r.ran[None, :], prec, CODE["fp32"])
        lacks = ~r.supported[used]
        bad = lacks.any(axis=1)
        for row in np.flatnonzero(bad):
            j = int(np.flatnonzero(lacks[row])[0])
            p = PRECISIONS[int(used[row, j])]
            reasons.setdefault(int(row), f"{self.tree.paths[j] or '<root>'}: "
                                         f"{self.profile.supports(p)[1]}")
        if self.max_weight_bytes is not None:
            held = self.held_weight_bytes(region, prec, form or self.form)
            over = held > self.max_weight_bytes
            for row in np.flatnonzero(over & ~bad):
                reasons.setdefault(int(row), f"weights {held[row] / 1e6:.1f} MB > the weight "
                                             f"budget {self.max_weight_bytes / 1e6:g} MB")
            bad = bad | over
        time = np.where(bad | sch.invalid, math.inf, time)
        fwd = Priced(time, parts, sch, reasons)
        if self.step is None:
            return fwd
        return self.step.price(self, fwd, rules, codes, form or self.form)

    # -- one plan --------------------------------------------------------------------------------
    def schedule(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> Schedule:
        """The replay of the recorded forward under one plan (row 0)."""
        rs, row = self._row(policy, default)
        region, prec, wrapped = rs.encode(row)
        return replay(self.trace, region, prec, wrapped, self.device_type, self._form(policy),
                      grad=self.grad_mode)

    def estimate(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> float:
        """Seconds per forward under ``policy`` (a Policy, or rules with ``default``)."""
        rs, row = self._row(policy, default)
        return float(self.price(rs, row, self._form(policy)).time[0])

    @property
    def fp32_time(self) -> float:
        """Seconds of the all-fp32 plan (the reference of ``speedup``)."""
        return self._fp32

    @property
    def reference_time(self) -> float:
        """Seconds of the model as given (a 16-bit model's own layout; ``fp32_time`` for an
        fp32 model): the search's scale of time, so that a bf16 model's walk weighs time
        against error as an fp32 model's does, not against an upcast nobody runs."""
        return self._given

    def speedup(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> float:
        """All-fp32 time over the plan's (0.0 when it cannot run on the target; 1.0 for a
        forward with nothing to price, e.g. ``nn.Identity``: no precision changes it)."""
        t = self.estimate(policy, default)
        if not math.isfinite(t):
            return 0.0
        return self._fp32 / t if t > 0 else 1.0

    def cannot_run(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> list[str]:
        """Why the plan cannot run on the target (empty: it can)."""
        rs, row = self._row(policy, default)
        got = self.price(rs, row, self._form(policy)).reasons.get(0)
        return [got] if got else []

    def breakdown(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> Breakdown:
        """Where the forward's (with ``step``: the training step's) time goes under the
        plan, per part and per module."""
        fwd = self.forward_breakdown(policy, default)
        if self.step is None or self._form(policy) != "train":
            return fwd
        return self.step.breakdown(self, fwd, policy, default)

    def forward_breakdown(self, policy: Policy | Mapping[str, str], default: str = "fp32"
                          ) -> Breakdown:
        """Where the forward's time goes under the plan, per part and per module."""
        sch = self.schedule(policy, default)
        kernels: list[tuple[int, Kernel]] = []
        parts = self.forward.price(sch, kernels)[0]
        by_module: dict[str, float] = {}
        for m, k in kernels:
            path = self.tree.paths[m] if m >= 0 else "<outside>"
            by_module[path] = by_module.get(path, 0.0) + k.time(self.profile)
        gemm_prec: dict[str, set[str]] = {}
        for i, op in enumerate(self.trace.ops):
            comp = sch.compute[i]
            if comp is not None and op.module >= 0:
                gemm_prec.setdefault(self.tree.paths[op.module], set()).add(
                    PRECISIONS[int(comp[0])])
        total = float(parts.sum())
        invalid = sch.reasons.get(0)
        return Breakdown(total if invalid is None else math.inf,
                         {k: float(v) for k, v in zip(PARTS, parts, strict=True)},
                         sch.cast_count(0), sch.cast_count(0, weights=True),
                         sum(int(k.launches) for _, k in kernels), by_module,
                         {p: ",".join(sorted(v, key=PRECISIONS.index))
                          for p, v in gemm_prec.items()}, invalid)

    def weight_bytes(self, policy: Policy | Mapping[str, str], default: str = "fp32") -> int:
        """Bytes of the weights (parameters and floating buffers) the applied plan holds on
        the device (``held_weight_bytes``)."""
        rs, row = self._row(policy, default)
        region, prec, _ = rs.encode(row)
        return int(round(float(self.held_weight_bytes(region, prec, self._form(policy))[0])))

    def held_weight_bytes(self, region: np.ndarray, prec: np.ndarray, form: str) -> np.ndarray:
        """(T,) bytes of the weights T plans hold: in the deploy form each tensor at its
        owner's storage width (a GEMM-format leaf's weight at its format's, scales
        included; a tensor tied between owners of two dtypes once per dtype); in the train
        form the fp32 masters plus each GEMM-format leaf's cached quantised weight
        (autocast's per-call casts are transient)."""
        fixed, owners, numel, matrix = self._params
        deploy = form == "deploy"
        store = _STORE_WIDTH[region]  # (T, M) storage bytes per element of each module
        fmt = _FORMAT_WIDTH[prec]  # (T, M) a GEMM format's bytes per element, else 0
        total = np.full(region.shape[0], fixed)
        for own, n, mat in zip(owners, numel, matrix, strict=True):
            seen: list[np.ndarray] = []
            for m in own:
                q = fmt[:, m] if mat else np.zeros(region.shape[0])
                if deploy:
                    w = np.where(q > 0, q, store[:, m])
                    new = np.ones_like(w, dtype=bool)
                    for s in seen:  # a tied tensor held once per distinct width
                        new &= w != s
                    total += n * np.where(new, w, 0.0)
                    seen.append(w)
                else:
                    if not seen:
                        total += n * 4.0
                        seen.append(q)
                    total += n * q  # the quantised copy beside the master
        return total

    def _param_table(self) -> tuple[float, list[list[int]], list[float], list[bool]]:
        """The floating parameters and buffers of the trace, for ``held_weight_bytes``: bytes
        of the others (fixed), and per floating tensor its owners, elements, and whether
        it is a matrix (a GEMM format quantises those, not a bias)."""
        index = {p: i for i, p in enumerate(self.trace.modules)}
        fixed, owners, numel, matrix = 0.0, [], [], []
        for v in self.trace.values:
            if v.source != "param":
                continue
            if v.dtype not in ("fp32", "bf16", "fp16"):
                fixed += v.numel * v.itemsize
                continue
            owners.append([index.get(p, 0) for p in (v.owners or (v.param.rpartition(".")[0],))])
            numel.append(float(v.numel))
            matrix.append(v.ndim >= 2)
        return fixed, owners, numel, matrix

    def train_memory(self, policy: Policy | Mapping[str, str], default: str = "fp32"
                     ) -> TrainMemory:
        """Weights, gradients, optimizer state and saved activations of one plan's training
        step (``step.StepPart.train_memory``); only a cost model that prices the step."""
        if self.step is None:
            raise ValueError("train_memory needs a cost model that prices the training step")
        return self.step.train_memory(self, dict(policy) if not isinstance(policy, Policy)
                                      else policy, default)

    def kernels(self, policy: Policy | Mapping[str, str], default: str = "fp32"
                ) -> list[tuple[str, Kernel]]:
        """Every kernel the plan launches, as (module path, kernel); for calibration."""
        sch = self.schedule(policy, default)
        out: list[tuple[int, Kernel]] = []
        self.forward.price(sch, out)
        return [(self.tree.paths[m] if m >= 0 else "<outside>", k) for m, k in out]


def make_cost_model(graph: LayerGraph, profile: DeviceProfile, batch_size: int | None = None,
                    mode: str = "eager", *, step: bool = False, fp8_backend: str | None = None,
                    **kwargs: Any) -> CostModel:
    """The cost model of a deployment ``mode``: "eager" (op by op) or "compile" (inductor).
    ``step``: in the training form, the whole training step (``cost.step.StepPart``:
    forward as ``mode`` runs it, backward, optimizer; ``fp8_backend`` says how fp8 leaves
    run their backward)."""
    if mode not in MODES:
        raise InputError(f"mode must be one of {', '.join(MODES)}, but got {mode!r}")
    if step and kwargs.get("form", "train") == "train":
        from autoprec.cost.step import StepPart, fp8_backward_of

        kwargs["step"] = StepPart(fp8_backward_of(fp8_backend),
                                  grad_times=kwargs.pop("grad_times", None))
    return CostModel(graph, profile, batch_size, mode=mode, **kwargs)


__all__ = ["Breakdown", "CostModel", "Kernel", "PARTS", "Priced", "device_type_of",
           "make_cost_model"]
