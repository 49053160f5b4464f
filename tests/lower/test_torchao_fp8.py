"""The torchao fp8 backend (torchao's float8 training) against the home-made emulation.

The home-made ``emulated`` fp8 backend is for CPUs and tests; it must be the recipe the
library runs. Each test feeds the same weights and input to both and compares the forward
output and the input, weight and bias gradients under one tolerance table (Transformer
Engine's ``dtype_tols`` style): bit for bit in fp32, where both quantise the same fp32
values with the same scales and multiply in fp32; within bf16's rounding where the input
arrives in bf16 (the home-made backend adds the bias before rounding, torchao after).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("torchao.float8")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from autoprec.device.capability import (  # noqa: E402
    best_fp8_backend,
    blockscale_capability,
    capability,
    fp8_backend_capability,
    torchao_fp8_kernels,
)
from autoprec.errors import InputError  # noqa: E402
from autoprec.lower import torchao_fp8  # noqa: E402
from autoprec.lower.backends import format_backends  # noqa: E402
from autoprec.lower.fp8 import drop_weight_caches, fp8_linear  # noqa: E402

#: (recipe, input dtype) -> tolerances of the home-made emulation against torchao's:
#: ``rtol``, and ``atol`` relative to the tensor's largest magnitude (``amax``).
TOLS: dict[tuple[str, torch.dtype], dict[str, float]] = {
    ("tensorwise", torch.float32): {"rtol": 0.0, "amax": 0.0},
    # bf16 outputs: torchao rounds the GEMM to bf16, then adds the bias in bf16; the
    # emulation adds in fp32 and rounds once: two bf16 roundings (2 * 2**-8) of the
    # tensor's scale apart where the bias cancels the product
    ("tensorwise", torch.bfloat16): {"rtol": 1.6e-2, "amax": 2 * 2.0**-8},
    # MXFP8 (RCEIL E8M0 scales, e4m3 blocks of 32 along each GEMM's reduction dim): the
    # emulated torchao path reads fp32 operands as the home-made one does: bit for bit
    ("mxfp8", torch.float32): {"rtol": 0.0, "amax": 0.0},
    ("mxfp8", torch.bfloat16): {"rtol": 0.0, "amax": 0.0},
}


def _data(dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """A (64 -> 48) Linear with bias, a (2, 24, 64) input with an outlier channel, and an
    output gradient spanning four decades (e5m2's range is what the gradient needs)."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(2, 24, 64, generator=g)
    x[..., 5] *= 40.0
    dy = torch.randn(2, 24, 48, generator=g) * torch.logspace(-3, 1, 48)
    return lin, x.to(dtype), dy.to(dtype)


def _run(fn, lin: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = fn(lin, x)
    y.backward(dy)
    return {"y": y.detach(), "grad_x": x.grad, "grad_w": lin.weight.grad,
            "grad_b": lin.bias.grad}


def _check(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], fmt: str,
           dtype: torch.dtype) -> None:
    tol = TOLS[fmt, dtype]
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == want.dtype or name in ("grad_w", "grad_b"), name
        torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"],
                                   atol=tol["amax"] * float(want.float().abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("recipe", "dtype"),
                         [k for k in sorted(TOLS, key=str) if k[0] != "mxfp8"])
def test_emulated_backend_is_torchaos_recipe(recipe: str, dtype: torch.dtype) -> None:
    lin, x, dy = _data(dtype)
    ours = _run(lambda m, v: fp8_linear(m, v, "emulated"), copy.deepcopy(lin), x, dy)
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    cfg = Float8LinearConfig(**{**cfg.__dict__, "emulate": True})
    lib = convert_to_float8_training(copy.deepcopy(lin), config=cfg)
    assert isinstance(lib, Float8Linear)
    theirs = _run(lambda m, v: m(v), lib, x, dy)
    _check(ours, theirs, recipe, dtype)
    # the gradients are not fp32's: e5m2 really rounded dY (else the test proves nothing)
    ref = _run(lambda m, v: m(v.float()), copy.deepcopy(lin), x, dy.float())
    assert not torch.allclose(ours["grad_w"], ref["grad_w"], rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_mxfp8_is_torchaos_mxfp8_training_recipe(dtype: torch.dtype) -> None:
    """The home-made MXFP8 (lower.blockscale) against torchao's MXFP8 training GEMMs
    (emulated here): forward and the three gradients; 40 tokens (padded to 64 for wgrad's
    blocks along M), N a multiple of 32 as mxfp8 training requires."""
    pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    from autoprec.lower.blockscale import blockscaled_linear

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    x = (torch.randn(2, 20, 64, generator=g) * torch.logspace(-2, 2, 64)).to(dtype)
    dy = (torch.randn(2, 20, 96, generator=g) * torch.logspace(-3, 1, 96)).to(dtype)
    ours = _run(lambda m, v: blockscaled_linear(m, v, "mxfp8", "emulated"),
                copy.deepcopy(lin), x, dy)
    theirs = _run(lambda m, v: blockscaled_linear(m, v, "mxfp8", "torchao"),
                  copy.deepcopy(lin), x, dy)
    _check(ours, theirs, "mxfp8", dtype)
    ref = _run(lambda m, v: m(v.float()), copy.deepcopy(lin), x, dy.float())
    assert not torch.allclose(ours["grad_w"], ref["grad_w"], rtol=1e-3, atol=0)


def test_torchao_backend_runs_the_library_module_on_the_leafs_parameters() -> None:
    lin, x, dy = _data(torch.float32)
    ours = _run(lambda m, v: fp8_linear(m, v, "torchao"), lin, x, dy)
    run = lin.__dict__[torchao_fp8.CACHE_ATTR]
    assert isinstance(run.module, Float8Linear) and run.module.weight is lin.weight
    assert run.module.config.emulate  # no fp8 kernels on this CPU
    emulated = _run(lambda m, v: fp8_linear(m, v, "emulated"), copy.deepcopy(lin), x, dy)
    for name in ours:
        assert torch.equal(ours[name], emulated[name]), name
    assert drop_weight_caches(lin) >= 1 and torchao_fp8.CACHE_ATTR not in lin.__dict__


def test_conv1d_runs_the_same_library_function() -> None:
    """HF's Conv1D (weight stored (in, out)) computes what the Linear of its transpose does."""
    from transformers.pytorch_utils import Conv1D

    lin, x, dy = _data(torch.float32)
    conv = Conv1D(48, 64)
    with torch.no_grad():
        conv.weight.copy_(lin.weight.t())
        conv.bias.copy_(lin.bias)
    a = _run(lambda m, v: fp8_linear(m, v, "torchao"), lin, x, dy)
    b = _run(lambda m, v: fp8_linear(m, v, "torchao"), conv, x, dy)
    assert torch.equal(a["y"], b["y"]) and torch.equal(a["grad_x"], b["grad_x"])
    assert torch.equal(a["grad_w"], b["grad_w"].t())


def test_rowwise_recipe_runs_and_differs_from_tensorwise() -> None:
    lin, x, dy = _data(torch.float32)
    row = _run(lambda m, v: fp8_linear(m, v, "torchao-rowwise"), copy.deepcopy(lin), x, dy)
    ten = _run(lambda m, v: fp8_linear(m, v, "torchao"), copy.deepcopy(lin), x, dy)
    ref = _run(lambda m, v: m(v), copy.deepcopy(lin), x, dy)
    assert lin.__dict__.get(torchao_fp8.CACHE_ATTR) is None  # copies were used
    rel = (row["y"] - ref["y"]).norm() / ref["y"].norm()
    assert 0 < rel < 0.05
    assert not torch.equal(row["grad_w"], ten["grad_w"])  # e4m3 row scales, not e5m2


def test_parameter_replaced_rebuilds_the_library_module() -> None:
    lin, x, _ = _data(torch.float32)
    fp8_linear(lin, x, "torchao")
    first = lin.__dict__[torchao_fp8.CACHE_ATTR].module
    lin.weight = torch.nn.Parameter(lin.weight.detach() * 2)
    y = fp8_linear(lin, x, "torchao")
    second = lin.__dict__[torchao_fp8.CACHE_ATTR].module
    assert second is not first and second.weight is lin.weight
    assert torch.equal(y, fp8_linear(lin, x, "emulated"))


def test_capability_on_this_cpu() -> None:
    ok, why = fp8_backend_capability("torchao", "cpu")
    assert ok and "emulate=True" in why
    real, why_not = torchao_fp8_kernels("torchao", "cpu")
    assert not real and "need a CUDA device" in why_not
    # emulation is not fp8 compute: the default stays the home-made emulation here
    assert best_fp8_backend("cpu", training=True)[0] == "emulated"
    assert not capability("fp8", None, "cpu")[0]
    ok, why = blockscale_capability("mxfp8", "torchao", "cpu")
    assert ok and "emulated (KernelPreference.EMULATED" in why
    # a training plan's mxfp8 runs torchao only where the block-scaled kernels run
    assert format_backends({"mxfp8"}, None, torch.device("cpu"), training=True)[0] == \
        {"fp8": "emulated", "mxfp8": "emulated"}


def test_torchao_is_a_training_backend() -> None:
    with pytest.raises(InputError, match="train form"):
        format_backends({"fp8"}, "torchao", torch.device("cpu"), training=False)
    by_format, backend, why = format_backends({"fp8"}, "torchao", torch.device("cpu"),
                                              training=True)
    assert by_format["fp8"] == backend == "torchao" and "emulate=True" in why


def test_missing_torchao_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real_find(name, *a))
    ok, why = fp8_backend_capability("torchao", "cpu")
    assert not ok and "autoprec[train-fp8]" in why


@pytest.mark.skipif(not torchao_fp8_kernels("torchao")[0],
                    reason=torchao_fp8_kernels("torchao")[1])
def test_fp8_kernels_on_the_gpu_match_the_emulation() -> None:  # pragma: no cover - GPU
    lin, x, dy = _data(torch.bfloat16)
    lin = lin.cuda()
    ours = _run(lambda m, v: fp8_linear(m, v, "torchao"), lin, x[:, :16].cuda(),
                dy[:, :16].cuda())
    assert not lin.__dict__[torchao_fp8.CACHE_ATTR].module.config.emulate
    emu = _run(lambda m, v: fp8_linear(m, v, "emulated"), copy.deepcopy(lin),
               x[:, :16].cuda(), dy[:, :16].cuda())
    for name in ours:  # fp8 kernels accumulate in another order (fast accumulation
        # forward): a few bf16 roundings of each tensor's scale apart
        want = emu[name].float()
        torch.testing.assert_close(ours[name].float(), want, rtol=3e-2,
                                   atol=4 * 2.0**-8 * float(want.abs().max()))


def test_missing_torchao_at_run_time_is_one_line_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from autoprec.io.extras import MissingExtra

    monkeypatch.setattr(torchao_fp8, "_FLOAT8", None)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"pip install 'autoprec\[train-fp8\]'"):
        fp8_linear(torch.nn.Linear(32, 32), torch.randn(4, 32), "torchao")
