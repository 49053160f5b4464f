"""torch.compile of a model with a policy applied.

Backend ``aot_eager``: dynamo + AOTAutograd (what breaks on autocast regions and
autograd.Functions) without inductor's C++ codegen, which takes ~2 minutes for this model
on the 2-core CPUs here (it was run by hand: one graph, no breaks, max |diff| 7e-4 in bf16).
"""

from __future__ import annotations

import pytest
import torch

from autoprec.apply.apply import apply_policy
from autoprec.formats.precisions import dtype_tols
from autoprec.policy import Policy
from tests.apply.test_apply_mixed import MIXED, _model

pytestmark = [pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


#: MIXED without its fp8 rule: autocast and tf32 regions, fp32 islands.
REGIONS = {k: v for k, v in MIXED.items() if v != "fp8"}


@pytest.mark.parametrize("layers", [REGIONS, MIXED], ids=["regions", "with_fp8"])
def test_apply_then_compile_forward_and_backward(layers: dict[str, str]) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    m, idx = _model()
    with apply_policy(m, Policy(layers=layers)):
        eager = m(idx)
        eager.float().square().mean().backward()
        g_eager = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        compiled = torch.compile(m, backend="aot_eager")
        out = compiled(idx)
        out.float().square().mean().backward()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for n, p in m.named_parameters():
        # summation order may differ (e.g. the embedding's scatter-add): fp32 tolerance
        torch.testing.assert_close(p.grad, g_eager[n], **dtype_tols("fp32"), msg=n)
    if layers is REGIONS:
        # the `with` regions, input upcasts and exit casts trace into one graph (fp8's
        # module backend is fp8.py's business: its weight cache compares data_ptr()s)
        assert _graph_breaks() == 0


def test_compile_then_apply_and_remove() -> None:
    m, idx = _model()
    compiled = torch.compile(m, backend="aot_eager")
    plain = compiled(idx)
    pol = Policy(layers={"_orig_mod.blocks.1": "bf16"})  # a path as seen on the wrapper
    with apply_policy(compiled, pol) as h:
        lowered = compiled(idx)
        with torch.no_grad():
            report = h.audit(lambda: compiled(idx))
    assert {r.computed for r in report.rows if r.layer.startswith("blocks.1.")} == {"bf16"}
    assert not torch.equal(lowered, plain)  # recompiled for the new forwards
    torch.testing.assert_close(compiled(idx), plain, rtol=0, atol=0)  # and back again


def _cuda_reason() -> str:
    from autoprec.device.capability import capability

    ok, why = capability("tf32", None, "cuda")
    return "" if ok else why


@pytest.mark.gpu
@pytest.mark.skipif(bool(_cuda_reason()), reason=_cuda_reason() or "tf32 on CUDA")
def test_tf32_region_under_compile_on_cuda_holds_or_is_refused_clearly() -> None:
    """A tf32 region flips torch.backends.cuda.matmul.allow_tf32 around its code; inside a
    compiled graph that flip is not traced. Either the compiled model computes as the eager
    tf32 one does, or applying it under compile is one clear CapabilityError."""
    from autoprec.errors import CapabilityError

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
    x = torch.randn(256, 1024, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    with apply_policy(m, Policy(default="tf32")):
        eager = m(x)
        fp32 = None
        try:
            compiled = torch.compile(m)(x)
        except CapabilityError as err:
            assert "torch.compile" in str(err)
            return
    with torch.no_grad():
        fp32 = m(x)
    # tf32 rounds the operands: the eager tf32 result differs from fp32; compiled must match it
    assert not torch.equal(eager, fp32)
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)
