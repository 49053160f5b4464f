"""The one output-dtype rule of the GEMM-format backends (``lower.autocast.compute_dtype``)."""

from __future__ import annotations

import torch

from autoprec.lower.autocast import compute_dtype


def test_the_backends_give_the_surrounding_compute_dtype() -> None:
    x = torch.ones(2, 2, dtype=torch.float16)
    assert compute_dtype(x) == torch.float16  # no autocast: the input's own
    assert compute_dtype(torch.ones(2, dtype=torch.int64)) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16  # autocast's dtype wins
