"""The quantised-weight cache under torch.distributed (lower.weight_cache).

FSDP2 writes each step's all-gathered weight into the storage it reused, under
``torch.autograd._unsafe_preserve_version_counter``: the cache's key (address, version)
cannot see it. Here that write is made by hand in a 1-rank gloo group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoprec.formats.fp8 import E4M3, quantize_fp8
from autoprec.lower.fp8 import _weight_fp8
from autoprec.lower.weight_cache import weight_cache_allowed


def _rewrite_unversioned(weight: torch.Tensor, value: torch.Tensor) -> None:
    """What FSDP2's all-gather copy-out does: new values, the same storage and version."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
        weight.copy_(value)


def test_cache_kept_in_one_process_and_blind_to_an_unversioned_write() -> None:
    assert weight_cache_allowed()
    lin = nn.Linear(16, 16)
    first = _weight_fp8(lin, lin.weight)
    assert _weight_fp8(lin, lin.weight) is first  # cached
    _rewrite_unversioned(lin.weight, 2 * lin.weight)
    assert _weight_fp8(lin, lin.weight) is first  # why it must be off under FSDP2


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_no_cache_under_torch_distributed(one_rank_group) -> None:
    assert not weight_cache_allowed()
    lin = nn.Linear(16, 16)
    _weight_fp8(lin, lin.weight)
    _rewrite_unversioned(lin.weight, 2 * lin.weight)
    wq, scale = _weight_fp8(lin, lin.weight)
    want_q, want_scale = quantize_fp8(lin.weight.detach(), E4M3)
    assert torch.equal(scale, want_scale) and torch.equal(wq, want_q)


def test_no_nvfp4_training_weight_cache_under_torch_distributed(one_rank_group) -> None:
    from autoprec.formats.nvfp4_train import fake_quant_nvfp4_2d, quantize_nvfp4_2d
    from autoprec.lower.nvfp4_train import _weight_2d

    lin = nn.Linear(32, 32)
    _weight_2d(lin, lin.weight, "torch")
    _rewrite_unversioned(lin.weight, 2 * lin.weight)
    got, want = _weight_2d(lin, lin.weight, "torch"), quantize_nvfp4_2d(lin.weight.detach())
    assert torch.equal(got.codes, want.codes) and torch.equal(got.tensor_scale, want.tensor_scale)
    _rewrite_unversioned(lin.weight, 3 * lin.weight)  # the emulated backend's fp32 values
    got = _weight_2d(lin, lin.weight, "emulated")
    assert torch.equal(got, fake_quant_nvfp4_2d(lin.weight.detach()))
