"""The ``torch`` fp8 backend trains in fp8: its backward runs dgrad and wgrad as
``torch._scaled_mm`` (e5m2 dY x e4m3 operands), the recipe of the emulated backend.

torch 2.13's ``_scaled_mm`` also runs on a CPU, so the backward's calls, operand dtypes
and numbers are checked here on the autograd function itself (the backend as a whole
needs CUDA SM >= 8.9, where the same calls run on the fp8 tensor cores).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec.lower.autocast import compute_dtype
from autoprec.lower.fp8 import _Fp8LinearFn, _weight_fp8


def _cpu_scaled_mm() -> tuple[bool, str]:
    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        one = torch.tensor(1.0)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return False, f"torch {torch.__version__} has no CPU _scaled_mm: {err}"
    return True, ""


pytestmark = pytest.mark.skipif(not _cpu_scaled_mm()[0], reason=_cpu_scaled_mm()[1])


class _ScaledMMs(TorchDispatchMode):
    """Records the operand dtypes of every _scaled_mm call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.overloadpacket is torch.ops.aten._scaled_mm:
            self.calls.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _run(backend: str, lin: torch.nn.Linear, x: torch.Tensor, dy: torch.Tensor,
         record: _ScaledMMs | None = None) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = _Fp8LinearFn.apply(x, lin.weight, lin.bias, backend, compute_dtype(x),
                           _weight_fp8(lin, lin.weight))
    if record is not None:
        with record:
            y.backward(dy)
    else:
        y.backward(dy)
    return {"y": y.detach(), "grad_x": x.grad, "grad_w": lin.weight.grad,
            "grad_b": lin.bias.grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_two_fp8_gemms_with_the_emulated_recipes_numbers(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = (torch.randn(2, 21, 64, generator=g) * 3).to(dtype)  # 42 tokens: wgrad pads to 48
    dy = (torch.randn(2, 21, 48, generator=g) * torch.logspace(-3, 1, 48)).to(dtype)
    rec = _ScaledMMs()
    real = _run("torch", copy.deepcopy(lin), x, dy, rec)
    assert rec.calls == [(torch.float8_e5m2, torch.float8_e4m3fn)] * 2  # dgrad, wgrad
    emu = _run("emulated", copy.deepcopy(lin), x, dy)
    for name, want in emu.items():
        got = real[name]
        assert got.dtype == want.dtype, name
        # scales applied after the fp32 sums instead of before: fp32 rounding apart (the
        # bf16 forward: its bias added in the GEMM's epilogue, one bf16 rounding)
        amax = float(want.float().abs().max())
        tol = 2.0**-8 if (name == "y" and dtype == torch.bfloat16) else 1e-6
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * amax,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _fp8_gpu() -> tuple[bool, str]:
    from autoprec.device.capability import fp8_backend_capability

    return fp8_backend_capability("torch")


@pytest.mark.skipif(not _fp8_gpu()[0], reason=_fp8_gpu()[1])
def test_on_an_fp8_gpu_the_backward_runs_on_the_tensor_cores() -> None:  # pragma: no cover
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48).cuda()
    x = torch.randn(2, 21, 64, generator=g).cuda()
    dy = (torch.randn(2, 21, 48, generator=g) * torch.logspace(-3, 1, 48)).cuda()
    rec = _ScaledMMs()
    real = _run("torch", copy.deepcopy(lin), x, dy, rec)
    assert rec.calls == [(torch.float8_e5m2, torch.float8_e4m3fn)] * 2
    emu = _run("emulated", copy.deepcopy(lin), x, dy)
    for name, want in emu.items():
        torch.testing.assert_close(real[name], want, rtol=1e-3,
                                   atol=1e-3 * float(want.abs().max()))
