"""A rule on a container whose forward never runs (ModuleList / ModuleDict) reaches its
children: the blocks are called by the list's owner, so they carry the rule themselves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.policy import Policy


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 16)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.blocks:
            h = torch.relu(blk(h))
        return self.heads["a"](h)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rule_on_a_module_list_lowers_every_block(precision: str) -> None:
    torch.manual_seed(0)
    m = Stack().eval()
    pol = Policy(default="fp32", layers={"blocks": precision, "heads": precision,
                                         "blocks.1": "fp32"})
    with torch.no_grad(), apply_policy(m, pol) as handle:
        report = handle.audit(lambda: m(torch.randn(4, 16)), strict=False)
    got = {r.layer: r.computed for r in report.rows}
    assert got["inp"] == "fp32"
    assert got["blocks.0"] == precision and got["blocks.2"] == precision
    assert got["blocks.1"] == "fp32"  # the more specific rule wins
    assert got["heads.a"] == precision
    assert not report.errors
