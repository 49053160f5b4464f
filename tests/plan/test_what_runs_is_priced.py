"""What runs is what is priced: a real forward under ``apply_policy``, counted op by op by a
dispatch mode written here (not the cost model's code), against the plan the cost model
prices — every cast, every GEMM's dtype, and the bytes moved.

The count is taken on this CPU for a CUDA target (h100): apply then runs the ops CUDA
autocast keeps in fp32 (layer_norm, softmax, ...) in fp32, as the plan assumes.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from autoprec.apply.apply import apply_policy, audit_policy
from autoprec.cost import CostModel, get_profile
from autoprec.plan.compile import compile_plan
from autoprec.policy import Policy, gemm_leaf_paths
from autoprec.trace import trace
from autoprec.workload.loading import load_model_file
from tests import zoo
from tests.helpers import ROOT
from tests.helpers.op_count import GEMMS, OpCount

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")
@dataclass
class Count:
    """Casts (``_to_copy`` changing the dtype), GEMMs by operand dtype and module, bytes."""

    casts: int
    gemms: dict[str, Counter[str]]
    bytes: int

    @classmethod
    def of(cls, count: OpCount) -> Count:
        gemms: dict[str, Counter[str]] = {}
        for o in count.kernels():
            if o.name in GEMMS or o.name.startswith("_scaled_dot_product"):
                gemms.setdefault(o.where or "", Counter())[o.dtypes] += 1
        return cls(sum(o.cast for o in count.kernels()), gemms,
                   sum(o.bytes for o in count.kernels()))


def run_counted(model: torch.nn.Module, policy: Policy, fwd, batch,
                target: str = "h100") -> Count:
    stack: list[str] = []
    skip = [0]
    fp8 = set(compile_plan(policy, model).format_leaves)
    handles = []
    for path, mod in model.named_modules():
        def pre(_m, _a, p=path):
            stack.append(p)
            skip[0] += p in fp8  # the emulated fp8 backend's insides are not what a GPU runs

        def post(_m, _a, _o, p=path):
            stack.pop()
            skip[0] -= p in fp8

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    counter = OpCount(stack, skip)
    try:
        with apply_policy(model, policy, target=target), torch.no_grad(), counter:
            fwd(model, batch)
    finally:
        for h in handles:
            h.remove()
    return Count.of(counter)


def _cases():
    out = []
    for name in ("mixed8", "wide"):
        spec = load_model_file(ROOT / "examples" / name / "model.py")
        out.append((name, spec.model(), spec.forward, spec.calibration_batches()[0]))
    return out + zoo.runnable(("bert", "gpt2", "vit", "mha"))


def _policies(model: torch.nn.Module) -> dict[str, Policy]:
    leaves = gemm_leaf_paths(model)
    half = len(leaves) // 2
    return {
        "uniform fp16": Policy(default="fp16"),
        "uniform tf32": Policy(default="tf32"),
        "fp32 + a rule per leaf": Policy(default="fp32", layers={k: "bf16" for k in leaves}),
        "bf16 + fp16 tail": Policy(default="bf16", layers={k: "fp16" for k in leaves[half:]}),
        "fp16 + fp32 islands": Policy(default="fp16",
                                      layers={k: "fp32" for k in leaves[::3]}),
    }


CASES = _cases()


@pytest.mark.parametrize("form", ["train", "deploy"])
@pytest.mark.parametrize("target", ["h100", "cpu"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_casts_gemm_dtypes_and_bytes_match_an_independent_count(case, target: str,
                                                                 form: str) -> None:
    """For a CUDA target (run here as CUDA would) and for a CPU target (CPU autocast's own
    op lists: layer_norm keeps bf16, cat promotes); in the training form (autocast over fp32
    masters) and the deploy form (weights stored in their precision, no autocast)."""
    name, model, fwd, batch = case
    graph = trace(model, batch, forward=fwd, tracers=("hooks",))
    cost = CostModel(graph, get_profile(target))  # priced at the traced (calibration) batch
    for label, train_pol in _policies(model).items():
        pol = Policy(default=train_pol.default, layers=train_pol.layers, form=form)
        if "tf32" in label and target == "cpu":
            continue  # the cpu profile has no tf32
        bd = cost.breakdown(pol)
        if form == "deploy" and bd.invalid is not None:
            # a module's output keeps its dtype in the deploy form (a consumer casts what it
            # needs): where a fp32 island meets 16-bit operands in one functional GEMM /
            # SDPA, the plan cannot run, and the real forward refuses it too; where 16-bit
            # leaves feed a functional GEMM / SDPA ruled fp32, it runs in 16 bits and the
            # real forward's audit refuses the rule
            if "different dtypes" in bd.invalid:
                with pytest.raises(RuntimeError):
                    run_counted(model, pol, fwd, batch, target=target)
            else:
                assert "but its rule says" in bd.invalid, (label, bd.invalid)
                m = copy.deepcopy(model)
                report = audit_policy(m, pol, lambda m=m: fwd(m, batch), target=target)
                assert any("but its GEMMs computed in" in e for e in report.errors), (
                    label, report.errors)
            continue
        assert bd.invalid is None, (label, bd.invalid)
        got = run_counted(model, pol, fwd, batch, target=target)
        assert got.casts == bd.casts + bd.weight_casts, (name, label)
        # the counter sees dtypes: a tf32 GEMM reads fp32 operands (rounded inside)
        planned = {m: set(p.replace("tf32", "fp32").split(","))
                   for m, p in bd.gemm_precision.items()}
        counted = {m: set(c) for m, c in got.gemms.items()}
        assert counted == planned, (name, label)
        if "tf32" in label:
            continue  # emulated here by rounding kernels a GPU does not run
        priced = sum(k.bytes for _, k in cost.kernels(pol))
        # nn.MultiheadAttention too: its in-projection and SDPA are recorded as the linear
        # and SDPA autocast sees (its in-projection's copy and bias add priced with it)
        assert priced == pytest.approx(got.bytes, rel=0.15), (name, label)


def test_one_uniform_policy_runs_like_one_global_autocast() -> None:
    """``default: bf16`` and no rules runs exactly what a user's one line of
    ``torch.autocast`` runs: the same casts, GEMM dtypes and bytes (for a CPU target, whose
    autocast lists this CPU applies). For a CUDA target, layer_norm runs in fp32 as on CUDA:
    two casts more per LayerNorm (its 16-bit input up, its fp32 output down for the next
    GEMM), and the plan counts them."""
    spec = load_model_file(ROOT / "examples" / "wide" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    count = OpCount()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), count:
        spec.forward(model, batch)
    theirs = Count.of(count)
    mine = run_counted(model, Policy(default="bf16"), spec.forward, batch, target="cpu")
    assert (mine.casts, mine.bytes) == (theirs.casts, theirs.bytes)
    assert sum(mine.gemms.values(), Counter()) == sum(theirs.gemms.values(), Counter())
    cuda = run_counted(model, Policy(default="bf16"), spec.forward, batch, target="h100")
    norms = sum(1 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    assert cuda.casts == theirs.casts + 2 * norms
    graph = trace(model, batch, forward=spec.forward, tracers=("hooks",))
    bd = CostModel(graph, get_profile("h100")).breakdown(Policy(default="bf16"))
    assert bd.casts + bd.weight_casts == cuda.casts


def test_deploy_default_bf16_runs_what_model_to_bf16_runs() -> None:
    """``form: deploy``, ``default: bf16`` and no rules runs exactly what the one-liner
    every deployment uses runs — ``model.to(torch.bfloat16)`` fed bf16 inputs: the same
    casts (none but the input's), GEMM dtypes and bytes, and the same outputs; the plan
    prices no weight cast."""
    spec = load_model_file(ROOT / "examples" / "wide" / "model.py")
    model, batch = spec.model(), spec.calibration_batches()[0]
    pol = Policy(default="bf16", form="deploy")
    with apply_policy(model, pol), torch.no_grad():
        mine_out = spec.forward(model, batch)
    mine = run_counted(model, pol, spec.forward, batch, target="cpu")
    theirs_model = copy.deepcopy(model).to(torch.bfloat16)
    count = OpCount()
    with torch.no_grad(), count:
        theirs_out = spec.forward(theirs_model, batch.to(torch.bfloat16))
    theirs = Count.of(count)
    assert torch.equal(mine_out, theirs_out)
    # the input's cast: the plan's root wrapper, and the user's batch.to() (counted too)
    assert (mine.casts, mine.bytes) == (theirs.casts, theirs.bytes)
    assert sum(mine.gemms.values(), Counter()) == sum(theirs.gemms.values(), Counter())
    graph = trace(model, batch, forward=spec.forward, tracers=("hooks",))
    bd = CostModel(graph, get_profile("h100")).breakdown(pol)
    assert (bd.casts, bd.weight_casts) == (mine.casts, 0)
