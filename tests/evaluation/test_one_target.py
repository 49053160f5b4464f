"""One ``Target`` resolved per run and carried through tune, eval and check (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoprec.evaluation.assess import time_rows
from autoprec.evaluation.rows import Row
from autoprec.evaluation.target import resolve_target
from autoprec.policy import Policy


def test_the_target_carries_name_mode_form_and_backend(tmp_path: Path) -> None:
    pol = Policy(default="bf16", form="train", target={"device": "A100", "mode": "compile"})
    given = resolve_target("H100", pol, fp8_backend="torch", cache_dir=tmp_path)
    assert (given.name, given.mode, given.form, given.fp8_backend, given.named) == (
        "h100", "compile", "train", "torch", True)
    recorded = resolve_target(None, pol, compile=False, form="deploy", cache_dir=tmp_path)
    assert (recorded.name, recorded.mode, recorded.form) == ("a100", "eager", "deploy")
    default = resolve_target(None, cache_dir=tmp_path)
    assert (default.name, default.named, default.form, default.local) == (
        "h100", False, "deploy", False)


def test_policies_are_applied_and_audited_as_the_target_runs_them(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    pol = Policy(default="fp32", layers={"1": "fp8"})
    target = resolve_target("h100", fp8_backend="emulated", cache_dir=tmp_path)
    with target.apply(net, pol) as handle:
        assert handle.fp8_backend == "emulated" and handle.target_device_type == "cuda"
    report = target.audit(net, pol, lambda: net(x))
    assert report.ok and report.fp8_backend == "emulated"


def test_a_remote_target_is_not_timed_and_says_why(tmp_path: Path) -> None:
    target = resolve_target("h100", cache_dir=tmp_path)
    if target.local:
        pytest.skip("an H100 is this machine")
    rows = [Row("tuned", "tuned", Policy(default="bf16"), 0.0, True, 2.0)]
    check = time_rows(rows, target, lambda m, b: m(b), None, None, None, measure=True,
                      not_measured="unused")
    assert not check.measured and check.reason == target.speed.note
    assert "no h100 here" in check.reason
