"""Every rule runs, in every mode, or is refused by name.

torch.nn's fused inference paths (``nn.TransformerEncoderLayer``'s
``_transformer_encoder_layer_fwd``, ``nn.MultiheadAttention``'s
``_native_multi_head_attention``) compute with their children's weights without calling
them, and ``nn.MultiheadAttention`` never calls ``out_proj`` (autoprec/fused.py). Before
this suite, a policy with fp8 on every FFN Linear of an ``nn.TransformerEncoder`` measured
error 2.9e-7 under ``no_grad`` (no rule ran) and ``check`` passed it.

The conformance matrix: each model of the zoo (torch.nn encoder and encoder-decoder,
MultiheadAttention used directly, a conv net, HF BERT / GPT-2 / Llama / T5 / ViT / Whisper)
under a policy mixing every precision: the audit is clean and the error is the same under
``no_grad``, ``inference_mode``, grad enabled and ``torch.compile`` (whose graph is audited
too).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from autoprec import apply_policy
from autoprec.errors import PolicyError
from autoprec.evaluation.check import check
from autoprec.fused import fused_paths_off
from autoprec.policy import Policy
from autoprec.trace import trace
from tests import zoo
from tests.apply.test_audit import _rotating_policy
from tests.helpers import ROOT

NN_MODEL = ROOT / "examples" / "nn_transformer" / "model.py"


def _fwd(case: zoo.Case):
    return case.forward or (lambda m, b: m(**b) if isinstance(b, dict) else m(b))


def _floats(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach().float()]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floats(o)]
    if hasattr(out, "values"):
        return [t for o in out.values() for t in _floats(o)]
    return []


def _error(out, ref: list[torch.Tensor]) -> float:
    got = _floats(out)
    num = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref))
    den = sum(float(r.pow(2).sum()) for r in ref)
    return math.sqrt(num / den) if den else 0.0


def _mixed_policy(model: torch.nn.Module) -> Policy:
    """default bf16; GEMM leaves in turn fp16, fp32, fp8 (where eligible), tf32, bf16."""
    return _rotating_policy(model)


# -- the table, redone ---------------------------------------------------------


def _nn_model():
    sys.path.insert(0, str(NN_MODEL.parent))
    try:
        import model as nn_model  # examples/nn_transformer/model.py
    finally:
        sys.path.pop(0)
    return nn_model


FFN_FP8 = {f"encoder.layers.{i}.linear{j}": "fp8" for i in range(3) for j in (1, 2)}


def test_fp8_ffn_rules_run_under_no_grad_as_with_grad() -> None:
    """The fused encoder path is off while the policy is applied: the fp8 rules run under
    no_grad and inference_mode as with grad enabled (before: 2.9e-7 against 0.022)."""
    m = _nn_model()
    net, x = m.build_model(), m.calibration_data()[0]
    with torch.no_grad():
        ref = _floats(net(x))
    with apply_policy(net, Policy(default="fp32", layers=FFN_FP8)):
        with torch.no_grad():
            e_nograd = _error(net(x), ref)
        with torch.inference_mode():
            e_inf = _error(net(x), ref)
        e_grad = _error(net(x), ref)
    assert e_nograd > 1e-3  # fp8 really ran (2.9e-7 when the fused kernel did)
    assert e_nograd == pytest.approx(e_grad, rel=1e-4)
    assert e_inf == pytest.approx(e_grad, rel=1e-4)
    assert torch.backends.mha.get_fastpath_enabled()  # restored on remove


def test_check_fails_the_fp8_ffn_policy_over_budget() -> None:
    """``check`` at 1 % used to pass this policy (error 0 under no_grad)."""
    res = check(str(NN_MODEL), Policy(default="fp32", layers=FFN_FP8, source="ffn.yaml"),
                max_error=0.01)
    assert not res.passed
    assert res.error is not None and res.error > 0.01
    assert any("budget" in str(r) for r in res.reasons)


def test_a_rule_on_out_proj_is_refused_by_name() -> None:
    case = zoo.mha()
    pol = Policy(default="fp32", layers={"attn.out_proj": "fp16"}, source="p.yaml")
    with pytest.raises(PolicyError, match=r"layers\['attn.out_proj'\].*never calls out_proj"):
        apply_policy(case.model, pol)


def test_out_proj_is_not_a_layer_of_its_own_and_attention_flops_are_counted() -> None:
    """The graph counts what runs: MHA's in/out projections and attention are the
    attention module's FLOPs (total = FlopCounterMode's), out_proj offers no precision."""
    from torch.utils.flop_counter import FlopCounterMode

    from autoprec.trace.measure import _custom_flops

    case = zoo.mha()
    graph = trace(case.model, case.batch, tracers=("hooks",))
    node, attn = graph["attn.out_proj"], graph["attn"]
    assert node.allowed == [] and "never calls out_proj" in node.disallowed["fp16"]
    assert "fp8" not in attn.allowed and {"bf16", "fp16"} <= set(attn.allowed)
    # with autoprec's formula for CPU SDPA, which torch counts as 0 (trace/measure.py)
    counter = FlopCounterMode(display=False, custom_mapping=_custom_flops())
    with torch.no_grad(), fused_paths_off(), counter:
        case.model(case.batch)
    assert attn.total_flops > 0
    assert graph.total_flops == counter.get_total_flops()


def test_the_audit_names_a_module_computed_from_its_weights() -> None:
    """Code that reads ``self.proj.weight`` bypasses proj's forward: its rule cannot hold."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.proj = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(self.a(x), self.proj.weight, self.proj.bias)

    net, x = Net().eval(), torch.randn(4, 16)
    with apply_policy(net, Policy(default="fp32", layers={"proj": "bf16"})) as h:
        report = h.audit(lambda: net(x), strict=False)
    assert not report.ok
    assert "'proj'" in report.errors[0] and "never ran" in report.errors[0]
    assert {r.layer: r.computed for r in report.rows}["proj"] == "bypassed"


def test_fused_paths_switched_back_on_fail_the_audit() -> None:
    case = zoo.nn_encoder()
    with apply_policy(case.model, _mixed_policy(case.model)) as h:
        torch.backends.mha.set_fastpath_enabled(True)
        try:
            report = h.audit(lambda: _fwd(case)(case.model, case.batch), strict=False)
        finally:
            torch.backends.mha.set_fastpath_enabled(False)
    assert any("fused inference paths are on" in e for e in report.errors)


# -- the conformance matrix -------------------------------------------------------------

MODELS = ["nn_encoder", "nn_seq2seq", "mha", "cnn", "bert", "gpt2", "llama", "t5", "vit",
          "whisper"]


def _reference(case: zoo.Case) -> list[torch.Tensor]:
    """autoprec's reference: fp32, fused paths off (as every measured forward runs)."""
    with torch.no_grad(), fused_paths_off():
        return _floats(_fwd(case)(case.model, case.batch))


@pytest.mark.parametrize("name", MODELS)
def test_eager_modes_audit_clean_and_agree(name: str) -> None:
    case = zoo.ALL[name]()
    fwd, ref = _fwd(case), _reference(case)
    errors = {}
    with apply_policy(case.model, _mixed_policy(case.model), target="h100") as h:
        with torch.no_grad():
            report = h.audit(lambda: fwd(case.model, case.batch))
            errors["no_grad"] = _error(fwd(case.model, case.batch), ref)
        with torch.inference_mode():
            errors["inference_mode"] = _error(fwd(case.model, case.batch), ref)
        errors["grad"] = _error(fwd(case.model, case.batch), ref)
    assert report.ok and any(r.computed != "-" for r in report.rows)
    assert errors["no_grad"] > 1e-5, errors  # the policy lowered something
    # The same rules in every mode; with autograd on, CPU SDPA may pick another kernel
    # (T5's float position bias: 0.6 % apart), so "agree" is 2 %, not bitwise.
    for mode, e in errors.items():
        assert e == pytest.approx(errors["no_grad"], rel=2e-2, abs=1e-7), (mode, errors)


def _compiled_matrix(name: str) -> None:
    case = zoo.ALL[name]()
    fwd, ref = _fwd(case), _reference(case)
    torch._dynamo.reset()
    with apply_policy(case.model, _mixed_policy(case.model), target="h100") as h, \
            torch.no_grad():
        eager = h.audit(lambda: fwd(case.model, case.batch))
        e_eager = _error(eager.result, ref)
        compiled = h.audit_compiled(lambda m: fwd(m, case.batch))
        e_compiled = _error(compiled.result, ref)
    assert compiled.ok, compiled.errors
    got = {r.layer: r.computed for r in compiled.rows}
    want = {r.layer: r.computed for r in eager.rows if r.computed != "-"}
    assert got == want  # the compiled graph computes every GEMM as the eager audit saw
    assert e_compiled == pytest.approx(e_eager, rel=1e-2, abs=1e-6)


def test_compiled_nn_encoder_keeps_the_plan() -> None:
    """The issue's case: compiled under no_grad, the policy used to be dropped whole."""
    _compiled_matrix("nn_encoder")


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in MODELS if m != "nn_encoder"])
def test_compiled_graph_audit_clean_and_error_agrees(name: str) -> None:
    _compiled_matrix(name)


@pytest.mark.slow
def test_inductor_compiled_error_equals_eager() -> None:
    """With inductor (CPU), the deployed program: default bf16 + fp16 blocks."""
    m = _nn_model()
    net, x = m.build_model(), m.calibration_data()[0]
    with torch.no_grad(), fused_paths_off():
        ref = _floats(net(x))
    torch._dynamo.reset()
    pol = Policy(default="bf16", layers={"encoder.layers": "fp16"})
    with apply_policy(net, pol), torch.no_grad():
        e_eager = _error(net(x), ref)
        e_compiled = _error(torch.compile(net)(x), ref)
    assert e_eager > 1e-4
    assert e_compiled == pytest.approx(e_eager, rel=0.05)


@pytest.mark.slow
def test_tune_eval_check_and_the_applied_model_measure_the_same_error(tmp_path: Path) -> None:
    """The issue's `tune --precisions fp8` case: tune's recorded error (held-out), eval's,
    check's and the applied model's own error under no_grad agree (before: 0 vs 0.0067)."""
    from autoprec import load_policy, tune
    from autoprec.evaluation.eval_report import eval_report
    from autoprec.workload.loading import load_model_file
    from autoprec.workload.scoring import reference, score

    res = tune(NN_MODEL, max_error=0.005, precisions=["fp8"], batch_size=4096, trials=6,
               out=tmp_path / "p.yaml", progress=False, cache_dir=tmp_path / "cache")
    pol = load_policy(res.path)
    assert any(p == "fp8" for p in pol.layers.values())  # it lowered something
    recorded = float(pol.metrics["error"])
    assert 0 < recorded <= 0.005
    evaluated = eval_report(NN_MODEL, Path(res.path))["error"]
    checked = check(str(NN_MODEL), pol).error
    spec = load_model_file(NN_MODEL)
    net, batches = spec.model(), spec.eval_batches()
    ref = reference(spec, net, batches)
    with apply_policy(net, pol):
        applied = score(spec, net, batches, ref).error
    for e in (evaluated, checked, applied):
        assert e == pytest.approx(recorded, rel=1e-4)
