"""Transformer Engine stays the optional fp8 path: its capability says why it does not
run here, its import error names the extra, and on an fp8 GPU with TE it trains."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from autoprec.device.capability import best_fp8_backend, fp8_backend_capability
from autoprec.errors import InputError
from autoprec.lower.backends import format_backends
from autoprec.lower.fp8 import fp8_linear

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.parametrize("backend", ["te", "te-delayed"])
def test_te_capability_says_why_not_on_this_machine(backend: str) -> None:
    ok, why = fp8_backend_capability(backend, "cpu")
    assert not ok and why == f"{backend} fp8: needs a CUDA device, this is cpu"
    # nothing silently falls back to TE: the default here is the emulation
    assert best_fp8_backend("cpu", training=True)[0] != backend


@pytest.mark.skipif(HAS_TE, reason="checks the hint shown without transformer_engine")
def test_te_without_the_library_names_the_extra() -> None:
    lin = torch.nn.Linear(32, 32)
    with pytest.raises(ImportError, match=r"pip install 'autoprec\[fp8\]'"):
        fp8_linear(lin, torch.randn(4, 32), "te")


def test_delayed_scaling_is_a_training_recipe() -> None:
    with pytest.raises(InputError, match="'te-delayed' is a training recipe"):
        format_backends({"fp8"}, "te-delayed", torch.device("cpu"), training=False)


@pytest.mark.skipif(not fp8_backend_capability("te")[0], reason=fp8_backend_capability("te")[1])
@pytest.mark.parametrize("backend", ["te", "te-delayed"])
def test_te_trains_in_fp8(backend: str) -> None:  # pragma: no cover - fp8 GPU with TE
    lin = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    y = fp8_linear(lin, x, backend)
    y.float().sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    ref = x.detach() @ lin.weight.detach().t() + lin.bias.detach()
    assert (y.float() - ref).norm() / ref.norm() < 0.1
