"""One ``Target`` resolved per run and carried through tune, eval and check (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoprec.evaluation.assess import time_rows
from autoprec.evaluation.rows import Row
from autoprec.policy import Policy
from autoprec.pricing.target import resolve_target


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
    timing = time_rows(rows, target, lambda m, b: m(b), None, None, None, measure=True,
                       not_measured="unused")
    assert not timing.measured and timing.note == target.speed.note
    assert "no h100 here" in timing.note


def test_the_target_decides_the_batch_and_what_it_runs(tmp_path: Path) -> None:
    """One place decides: the batch size (given, else the policy's, else the calibration
    batch's), and what the target runs (its profile; this machine's capability only for a
    local target)."""
    policy = Policy(default="bf16", target={"device": "h100", "batch_size": 256})
    assert resolve_target(None, policy, cache_dir=tmp_path).batch_size == 256
    t = resolve_target("h100", policy, batch_size=8, cache_dir=tmp_path)
    assert t.name == "h100" and t.batch_size == 8 and t.deploy_batch(torch.zeros(4, 2)) == 8
    bare = resolve_target("h100", cache_dir=tmp_path)
    assert bare.batch_size is None and bare.deploy_batch(torch.zeros(4, 2)) == 4
    assert t.supports("fp8") == t.profile.supports("fp8")
    assert t.supports("fp8")[0] and not resolve_target("t4", cache_dir=tmp_path).supports("fp8")[0]
    cpu = resolve_target("cpu", cache_dir=tmp_path)
    assert cpu.local and cpu.runs_here("fp32") == (True, cpu.runs_here("fp32")[1])
    if not t.local:
        assert t.runs_here("fp32") is None
