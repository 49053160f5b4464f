"""The audit: what every GEMM actually computed in, on a real forward."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.apply.audit import AuditError
from autoprec.errors import AutoprecError
from autoprec.formats.precisions import PRECISIONS
from autoprec.policy import Policy, PolicyWarning, gemm_leaf_paths
from autoprec.policy.modules import format_eligible
from tests import zoo

pytestmark = pytest.mark.filterwarnings("ignore:.*fingerprint.*:autoprec.policy.PolicyWarning")


class Net(nn.Module):
    """One GEMM of each kind the audit reports: a Linear, a Conv1d and a fp32 router."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.conv = nn.Conv1d(32, 32, 3, padding=1)
        self.norm = nn.LayerNorm(32)
        self.router = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 32)
        h = self.norm(self.fc(x))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.router(h)


class Router(nn.Module):
    """Forces fp32 as MoE routers do (autocast off): a rule lowering it cannot work."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.gate.weight, self.gate.bias)


def _x() -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("p", PRECISIONS)
def test_every_gemm_reports_its_precision(p: str) -> None:
    torch.manual_seed(0)
    m, x = Net(), _x()
    fmt = p in ("fp8", "mxfp8", "nvfp4")  # Linear backends: a conv keeps fp32
    pol = Policy(default="fp32", layers={"fc": p, "conv": "fp32" if fmt else p})
    with apply_policy(m, pol) as h, torch.no_grad():
        report = h.audit(lambda: m(x))
    rows = {r.layer: r for r in report.rows}
    assert rows["fc"].computed == p and rows["fc"].ok
    assert rows["conv"].computed == ("fp32" if fmt else p)
    assert rows["router"].computed == "fp32"  # the functional GEMM in the router's code
    assert rows["router.gate"].computed == "-"  # never called as a module
    assert report.ok and report.result.shape == (2, 8, 16)


def test_a_rule_that_did_not_lower_is_an_error_naming_the_layer() -> None:
    torch.manual_seed(0)
    m, x = Net(), _x()
    with apply_policy(m, Policy(layers={"router": "bf16"})) as h, torch.no_grad():
        with pytest.raises(AuditError, match=r"layer 'router': rule router says bf16, but "
                                             r"its GEMMs computed in fp32") as err:
            h.audit(lambda: m(x))
        assert isinstance(err.value, AutoprecError) and err.value.exit_code == 1
        report = h.audit(lambda: m(x), strict=False)
    bad = [r for r in report.rows if not r.ok]
    assert [(r.layer, r.rule, r.expected, r.computed) for r in bad] == [
        ("router", "router", "bf16", "fp32")]
    assert report.to_frame().loc[lambda d: ~d.ok, "layer"].tolist() == ["router"]


def test_a_rule_on_a_norm_alone_is_a_warning() -> None:
    torch.manual_seed(0)
    m, x = Net(), _x()
    with apply_policy(m, Policy(layers={"norm": "bf16", "fc": "fp16"})) as h, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = h.audit(lambda: m(x))
    assert report.ok
    msgs = [str(w.message) for w in caught if issubclass(w.category, PolicyWarning)]
    assert any("layers['norm']: bf16 rule covers no autocast-eligible op (LayerNorm" in s
               for s in msgs)
    assert report.warnings == [s for s in msgs if "layers['norm']" in s]


def test_a_rule_on_a_module_that_did_not_run_is_a_warning() -> None:
    case = zoo.branchy()  # the `neg` branch never runs on this batch
    warned = pytest.warns(PolicyWarning, match=r"layers\['neg'\]: bf16 rule: the module did "
                                               r"not run")
    with apply_policy(case.model, Policy(layers={"neg": "bf16"})) as h, torch.no_grad(), \
            warned:
        report = h.audit(lambda: case.model(case.batch))
    assert {r.layer: r.computed for r in report.rows}["neg"] == "-"


def test_fp32_island_on_a_norm_is_not_warned(monkeypatch) -> None:
    """Keeping a norm in fp32 inside a bf16 model does act: it upcasts its input."""
    torch.manual_seed(0)
    m, x = Net(), _x()
    norm_inputs: list[torch.dtype] = []
    layer_norm = F.layer_norm

    def spy(inp: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        norm_inputs.append(inp.dtype)
        return layer_norm(inp, *args, **kwargs)

    monkeypatch.setattr(F, "layer_norm", spy)
    with apply_policy(m, Policy(default="bf16", layers={"norm": "fp32"})) as h, \
            warnings.catch_warnings():
        warnings.simplefilter("error", PolicyWarning)
        report = h.audit(lambda: m(x), strict=False)
    assert report.warnings == []
    assert {r.layer: r.computed for r in report.rows}["fc"] == "bf16"  # what feeds the norm
    assert norm_inputs and set(norm_inputs) == {torch.float32}  # upcast by the fp32 rule


def _rotating_policy(model: nn.Module) -> Policy:
    """Every GEMM leaf gets a precision in turn (fp8 where eligible), default bf16."""
    layers = {}
    cycle = ["fp16", "fp32", "fp8", "tf32", "bf16"]
    for i, path in enumerate(gemm_leaf_paths(model)):
        p = cycle[i % len(cycle)]
        if p == "fp8" and not format_eligible(model.get_submodule(path), "fp8"):
            p = "fp16"
        layers[path] = p
    return Policy(default="bf16", layers=layers)


@pytest.mark.parametrize("name", list(zoo.ALL))
def test_zoo_models_rotating_precisions_audit_clean(name: str) -> None:
    """Every model of the test zoo (HF BERT, GPT-2 with Conv1D, Llama, T5, ViT, ...) runs a
    policy rotating all precisions over its GEMM leaves: no dtype error, forward and
    backward, and every GEMM computes in its rule's precision."""
    case = zoo.ALL[name]()
    model = case.model
    pol = _rotating_policy(model)
    fwd = case.forward or (lambda m, b: m(**b) if isinstance(b, dict) else m(b))
    # A CUDA target (run here as CUDA would: CPU autocast's cat refuses a fp16 tensor in a
    # bf16 region, e.g. Llama's rotate_half of a fp16 q_proj output; CUDA's cat does not)
    with apply_policy(model, pol, target="h100") as h:
        report = h.audit(lambda: fwd(model, case.batch))
        out = fwd(model, case.batch)
        first = out if isinstance(out, torch.Tensor) else next(
            v for v in out.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
        first.float().sum().backward()
    assert report.ok, report.errors
    ran = [r for r in report.rows if r.computed != "-"]
    assert ran and all(r.computed == r.expected for r in ran)
    assert len({r.computed for r in ran}) >= 2  # really mixed
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n
