"""Fixtures of the probe tests (models in probe_models.py)."""

from __future__ import annotations

import pytest
import torch

from tests.probe.probe_models import B, Known


@pytest.fixture(scope="session")
def known_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, 16, generator=g) for _ in range(2)]


@pytest.fixture(scope="session")
def known_table(known_batches):
    from autoprec.probe import probe

    return probe(Known().eval(), known_batches, ["tf32", "bf16", "fp16", "fp8"],
                 e2e="all", progress=False)
