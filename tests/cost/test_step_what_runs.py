"""What a training step runs is what the step is priced on: a real forward + ``loss.backward()``
+ AdamW step under ``apply_policy`` (training form), counted op by op by a dispatch mode
of the tests' own (``tests.helpers.op_count``, not the pricer's code), against ``StepPart``'s derivation — the gradient
GEMMs (their dtypes and FLOPs, dgrad and wgrad), the casts of the backward, and the saved
activations (counted through ``torch.autograd.graph.saved_tensors_hooks``).

The step runs on this CPU for a CUDA target (h100): apply runs the ops CUDA autocast keeps in
fp32 in fp32, as the plan assumes (``tests/plan/test_what_runs_is_priced.py`` does the same
for the forward alone).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils._pytree import tree_flatten

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import ADAMW_FOREACH, STEP_PARTS, StepPart
from autoprec.plan.backward import backward
from autoprec.policy import Policy, gemm_leaf_paths
from autoprec.trace import trace
from tests import zoo
from tests.helpers.op_count import OpCount

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
def _loss(out: object) -> torch.Tensor:
    t = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum(x.sum() for x in t)  # its scalars' casts are not counted (the model's are)


def _step(model, policy, fwd, batch):  # noqa: ANN001
    """One forward + backward + AdamW step under the policy, counted; the saved activations'
    bytes (distinct storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and t.is_floating_point():
            saved[s.data_ptr()] = s.nbytes()
        return t

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    count = OpCount()
    with apply_policy(model, policy, target="h100"):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), count:
            loss = _loss(fwd(model, batch))
        with count:
            count.phase = "backward"
            loss.backward()
            count.phase = "optimizer"
            opt.step()
    return count, sum(saved.values())


def _cases():
    return zoo.runnable(("mlp", "gpt2", "bert"))


def _policies(model: torch.nn.Module) -> dict[str, Policy]:
    leaves = gemm_leaf_paths(model)
    return {
        "fp32": Policy(default="fp32"),
        "uniform bf16": Policy(default="bf16"),
        "fp32 + a rule per leaf": Policy(default="fp32", layers={k: "bf16" for k in leaves}),
        "fp16 + fp32 islands": Policy(default="fp16", layers={k: "fp32" for k in leaves[::3]}),
    }


CASES = _cases()


def _priced_gemms(cost: CostModel, pol: Policy) -> tuple[Counter, Counter, int]:
    """The step pricer's gradient GEMMs as (dtype, FLOPs) and its backward casts."""
    sch = cost.schedule(pol)
    bwd = backward(sch)
    names = {0: "fp32", 1: "fp32", 2: "bf16", 3: "fp16"}
    gemm, att = Counter(), 0
    for k in bwd.gemms(0):
        if k.what == "attention":
            att += 1
        else:
            gemm[(names[int(k.compute[0])], k.flops)] += 1
    fwd_g = Counter()
    for i, op in enumerate(sch.trace.ops):
        if op.kind == "gemm":
            fwd_g[(names[int(sch.compute[i][0])], op.flops)] += 1
    casts = sum(1 for k in bwd.kernels if k.what == "cast" and k.on[0])
    return Counter({"forward": fwd_g, "backward": gemm}), Counter(backward=att), casts


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradient_gemms_casts_and_saved_bytes_match_a_real_step(case) -> None:
    name, model, fwd, batch = case
    graph = trace(model, batch, forward=fwd, tracers=("hooks",))
    cost = CostModel(graph, get_profile("h100"), step=StepPart())
    for label, pol in _policies(model).items():
        priced, att, bcasts = _priced_gemms(cost, pol)
        bd = cost.breakdown(pol)
        assert bd.invalid is None, (name, label, bd.invalid)
        got, saved = _step(model, pol, fwd, batch)
        # every GEMM of the backward, at the dtype and FLOPs priced (dgrad and wgrad)
        assert got.gemms("backward") == priced["backward"], (name, label)
        assert got.gemms("forward") == priced["forward"], (name, label)
        attention = sum(n for k, n in got.names("backward").items()
                        if k.startswith("_scaled_dot_product"))
        assert attention == att["backward"], (name, label)
        # the backward of every cast is a cast back (a 0-dim cast: the test's loss's)
        assert got.casts("backward", min_dim=1) == bcasts == bd.backward_casts, (name, label)
        assert got.casts("forward", min_dim=1) == bd.casts + bd.weight_casts, (name, label)
        # saved activations: the estimate against what autograd packed
        assert bd.memory is not None
        assert bd.memory.activations == pytest.approx(saved, rel=0.1), (name, label)


def test_dgrad_and_wgrad_split_by_operand() -> None:
    """A Linear stack over a model input: the first layer has no dgrad (its input needs no
    gradient), every layer one wgrad; both at the forward's FLOPs."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16)).float().eval()
    x = torch.randn(8, 32)
    cost = CostModel(trace(model, x, tracers=("hooks",)), get_profile("h100"), step=StepPart())
    bwd = backward(cost.schedule(Policy(default="bf16")))
    gemms = [(k.part, k.flops) for k in bwd.gemms(0)]
    assert sorted(gemms) == sorted([("wgrad", 2 * 8 * 32 * 64), ("wgrad", 2 * 8 * 64 * 16),
                                    ("dgrad", 2 * 8 * 64 * 16)])


def test_step_parts_optimizer_scaler_and_fp8_backward() -> None:
    """The optimizer reads and writes the fp32 masters and AdamW's states; the GradScaler is
    priced only where fp16 runs; an fp8 leaf's backward runs in fp8 (TE / torchao) or in fp32
    (autoprec's dequantising backend), and the fp32 one is slower."""
    case = zoo.mlp()
    graph = trace(case.model, case.batch, tracers=("hooks",))
    prof = get_profile("h100")
    cost = CostModel(graph, prof, batch_size=4096, step=StepPart())
    n = sum(p.numel() for p in case.model.parameters())
    bd = cost.breakdown(Policy(default="fp32"))
    assert set(bd.parts) == set(STEP_PARTS)
    assert bd.parts["optimizer"] == pytest.approx(28 * n / prof.bandwidth
                                                  + prof.launch_overhead_s)
    assert bd.parts["scaler"] == 0.0
    assert cost.breakdown(Policy(default="fp16")).parts["scaler"] > 0.0
    assert cost.breakdown(Policy(default="bf16")).parts["scaler"] == 0.0
    foreach = CostModel(graph, prof, batch_size=4096, step=StepPart(optimizer=ADAMW_FOREACH))
    assert foreach.breakdown(Policy(default="fp32")).parts["optimizer"] > bd.parts["optimizer"]
    pol = Policy(default="bf16", layers={"fc2": "fp8"})
    te = cost.breakdown(pol)
    deq = CostModel(graph, prof, batch_size=4096, step=StepPart(fp8_backward="fp32")).breakdown(pol)
    assert deq.parts["dgrad"] + deq.parts["wgrad"] > te.parts["dgrad"] + te.parts["wgrad"]
    assert te.parts["fp8_scaling"] > cost.breakdown(Policy(default="bf16")).parts["fp8_scaling"]
    sch = cost.schedule(pol)
    fc2 = [k for k in backward(sch).gemms(0) if k.compute is not None
           and int(k.compute[0]) == 4]  # fp8's precision code
    assert {k.part for k in fc2} == {"dgrad", "wgrad"}
    assert math.isclose(cost.estimate(pol), te.total_s)


def test_memory_limit_makes_a_plan_infeasible_with_the_reason() -> None:
    case = zoo.mlp()
    cost = CostModel(trace(case.model, case.batch, tracers=("hooks",)), get_profile("h100"), step=StepPart())
    mem = cost.train_memory(Policy(default="fp32"))
    assert mem.weights == mem.grads == mem.optimizer / 2  # fp32 masters, grads, AdamW m, v
    cost.max_train_bytes = mem.peak_bytes * 0.5
    assert cost.cannot_run(Policy(default="fp32"))[0].startswith("training memory")
    assert cost.speedup(Policy(default="fp32")) == 0.0
