"""``autoprec.device.targets``: the one reading of target and device names."""

from __future__ import annotations

import pytest

from autoprec.device.targets import (
    cuda_index,
    device_kind,
    device_type,
    is_cpu,
    is_cpu_target,
    named_target,
)
from autoprec.errors import InputError


def test_a_target_given_wins_over_the_policys_and_neither_is_none() -> None:
    assert named_target(" H100 ", "a100") == "h100"
    assert named_target(None, "A100") == "a100"
    assert named_target(None, None) is None
    assert named_target("", None) is None


def test_device_types_of_targets() -> None:
    assert [device_type(t) for t in ("cpu", "CPU", "cpu-3f2a", "h100", "cuda")] == [
        "cpu", "cpu", "cpu", "cuda", "cuda"]
    assert is_cpu_target("cpu-3f2a") and not is_cpu_target("l4")


def test_device_strings() -> None:
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda"]
    assert is_cpu("cpu") and not is_cpu("cuda:0")
    assert (cuda_index("cuda"), cuda_index("cuda:3")) == (0, 3)
    with pytest.raises(InputError, match=r"timer: unknown device 'tpu'; expected cpu or cuda"):
        device_kind("tpu", "timer")
    for bad in ("cpu", "cuda:x", "tpu:0"):
        with pytest.raises(InputError):
            cuda_index(bad)
