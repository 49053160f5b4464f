"""Every committed policy (``policies/*.yaml``, written by ``benchmarks/run_all.py``) still
passes ``autoprec check`` on its model: the README's table cites these files.

A policy names its model (``model.name``), which is ``examples/<name>/model.py``. Each
model is loaded once per session and shared by its policies (MiniLM's load and the digits
CNN's training take seconds). ``policies/examples/`` holds hand-written examples for other
models and is tested in tests/policy.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from autoprec.evaluation.check import check
from autoprec.policy import load_policy
from autoprec.workload.loading import ModelSpec, load_model_file
from tests.helpers import ROOT

POLICIES = sorted((ROOT / "policies").glob("*.yaml"))  # not recursive: examples/ excluded
SLOW_MODELS = {"minilm", "gpt", "vit", "digits_cnn"}  # seconds each; trap's stay quick


@functools.cache
def spec_of(name: str) -> ModelSpec:
    path = ROOT / "examples" / name / "model.py"
    if not path.exists():
        raise AssertionError(f"no examples/{name}/model.py for a committed policy of {name!r}")
    return load_model_file(path)


def _param(path: Path) -> object:
    name = load_policy(path).model_name
    marks = [pytest.mark.slow] if name in SLOW_MODELS else []
    return pytest.param(path, id=path.name, marks=marks)


@pytest.mark.parametrize("policy_path", [_param(p) for p in POLICIES])
def test_committed_policy_passes_check(policy_path: Path) -> None:
    policy = load_policy(policy_path)
    assert policy.model_name, f"{policy_path.name}: no model.name, cannot find its model.py"
    result = check(spec_of(policy.model_name), policy_path)
    assert result.passed, f"{policy_path.name}: {'; '.join(result.reasons)}"
    # the figures the README cites: the policy's own target and batch size were checked
    assert result.target == policy.target_device
    assert result.batch_size == policy.batch_size
    assert result.fingerprint_match is True
    recorded = policy.metrics.get("est_speedup")
    assert result.est_speedup == pytest.approx(recorded, rel=1e-3), (
        f"{policy_path.name}: est. speed-up {result.est_speedup:.4f}x now, {recorded}x when "
        "tuned (the cost model changed?): rerun python -m benchmarks.run_all")
