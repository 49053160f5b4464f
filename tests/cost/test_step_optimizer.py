"""The optimizer step of a CPU training step priced as it runs: torch's default AdamW (its
per-parameter loop) timed here over the model's trainable parameter sizes
(``measure.optimizer_time``). The step timed runs the same ops, as many and over as many
bytes, as a real training step's ``optimizer.step()``, counted by the tests' own dispatch
mode (``tests.helpers.op_count``); ``StepPart`` prices the CPU's default optimizer at that
time, and the cache keeps it per parameter set."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import ADAMW_FUSED, ADAMW_LOOP, StepPart
from autoprec.measure.optimizer_time import adamw_step, cached_or_measured_optimizer
from autoprec.policy import Policy
from autoprec.trace import trace
from tests.helpers import one_torch_thread
from tests.helpers.op_count import OpCount

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


class TiedLM(nn.Module):
    """An embedding whose weight the output head shares (a tied parameter: AdamW sees it
    once), a frozen norm (no optimizer state)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.norm.requires_grad_(False)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, 50)
        return self.head(self.norm(torch.relu(self.fc(self.emb(ids)))))


def _numels(graph) -> list[int]:  # noqa: ANN001
    """What the target passes the timing: the trace's trainable parameters' sizes."""
    return [v.numel for v in graph.ops.values if v.source == "param" and v.trainable
            and v.param]


def _counted(step) -> Counter:  # noqa: ANN001
    count = OpCount()
    with count:
        step()
    return Counter((o.name, o.bytes) for o in count.kernels())


def test_the_timed_adamw_step_runs_what_a_real_training_steps_optimizer_runs() -> None:
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 8))
    graph = trace(model, ids, tracers=("hooks",))
    numels = _numels(graph)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(numels) == sorted(p.numel() for p in trainable)  # the tied weight once
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    for _ in range(2):  # the second step: its state allocated, as every step after
        opt.zero_grad(set_to_none=True)
        model(ids).float().sum().backward()
        if _ == 0:
            opt.step()
    real = _counted(opt.step)
    timed = _counted(adamw_step(numels))
    assert timed == real
    # torch's CPU default: a loop over the parameters (no foreach), the square root of
    # exp_avg_sq out of place per parameter
    assert not any(name.startswith("_foreach") for name, _ in real)
    assert sum(n for (name, _), n in real.items() if name == "sqrt") == len(numels)


def test_the_cpu_default_optimizer_is_priced_at_its_timing(tmp_path) -> None:  # noqa: ANN001
    model = TiedLM().eval()
    graph = trace(model, torch.randint(0, 50, (2, 8)), tracers=("hooks",))
    with one_torch_thread():
        timed = cached_or_measured_optimizer(_numels(graph), tmp_path, "d", measure_now=True)
    assert timed is not None and timed > 0
    cpu = get_profile("cpu")
    cost = CostModel(graph, cpu, step=StepPart(optimizer_s=timed))
    assert cost.step.optimizer is ADAMW_LOOP
    for prec in ("fp32", "bf16"):
        assert cost.breakdown(Policy(default=prec)).parts["optimizer"] == timed
    bytes_only = CostModel(graph, cpu, step=StepPart()).breakdown(Policy(default="fp32"))
    assert bytes_only.parts["optimizer"] != timed
    # a timing of the default loop does not price another optimizer
    fused = CostModel(graph, cpu, step=StepPart(optimizer=ADAMW_FUSED, optimizer_s=timed))
    assert fused.breakdown(Policy(default="fp32")).parts["optimizer"] != timed


def test_the_timing_is_cached_per_parameter_set(tmp_path) -> None:  # noqa: ANN001
    with one_torch_thread():
        got = cached_or_measured_optimizer([10, 20], tmp_path, "abc", measure_now=True)
    assert got is not None and (tmp_path / "optim-abc.json").exists()
    assert cached_or_measured_optimizer([10, 20], tmp_path, "abc", measure_now=False) == got
    # another parameter set under the same digest is not read from the file
    assert cached_or_measured_optimizer([10, 21], tmp_path, "abc", measure_now=False) is None


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 32) -> (B, 8)
        return self.fc2(torch.relu(self.fc1(x)))


def test_weight_gradients_cast_to_their_masters_are_priced_at_the_timed_casts(monkeypatch
                                                                              ) -> None:  # noqa: ANN001
    """Under bf16 autocast each 16-bit weight copy's gradient is cast to its fp32 master in
    the backward, as many as a real step runs; where the weights overflow L2 only a
    weight's cast of each parameter size is timed (cycled through copies), and the backward's
    cast of that size is priced at it, not at a bandwidth figure."""
    import autoprec.measure.ops as ops_mod
    from autoprec.cost.op_times_record import cast_key
    from autoprec.measure.ops import measure
    from autoprec.plan.backward import backward
    from autoprec.plan.dtype_codes import DTYPES

    model = TwoLinear().eval()
    x = torch.randn(4, 32)
    graph = trace(model, x, tracers=("hooks",))
    monkeypatch.setattr(ops_mod, "_span", lambda footprint: 1 << 22)  # as past L2
    with one_torch_thread():
        times = measure(graph.ops, graph.batch_size, precisions=["bf16"])
    cost = CostModel(graph, get_profile("cpu"), op_times=times, step=StepPart())
    pol = Policy(default="bf16")
    sch = cost.schedule(pol)
    vals = graph.ops.values
    priced = [(k, s) for k, s in cost.step._kernel_seconds(cost.forward.roofline,
                                                           cost.forward.table, sch,
                                                           backward(sch))
              if k.what == "cast" and k.on[0] and vals[k.cast[0]].source == "param"]
    # what a real step's backward casts: each weight's and bias's gradient, bf16 -> fp32
    count = OpCount()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    with count:
        count.phase = "backward"
        out.float().sum().backward()
    real = sorted(o.bytes // 6 for o in count.ops if o.phase == "backward" and o.cast
                  and o.first == torch.bfloat16 and o.outs == (torch.float32,)
                  and o.bytes // 6 != out.numel())  # (not out.float()'s own cast back)
    sizes = sorted(vals[k.cast[0]].numel for k, _ in priced)
    assert sizes == real == sorted(p.numel() for p in model.parameters())
    for k, sec in priced:
        v, src, dst = k.cast
        assert DTYPES[int(src[0])] == "bf16" and DTYPES[int(dst[0])] == "fp32"
        key = cast_key(vals[v].numel, "bf16", "fp32", True)
        assert key in times.casts and cast_key(vals[v].numel, "bf16", "fp32") not in times.casts
        assert sec[0] == pytest.approx(times.casts[key])


def test_a_local_cpu_target_times_the_optimizer_with_the_ops(tmp_path) -> None:  # noqa: ANN001
    """The target's cost model of a training step on this CPU (``SpeedSource.cost_model``)
    times the optimizer beside the op and gradient timings, caches it, and prices it."""
    from autoprec.measure import this_machine
    from autoprec.pricing.speed_source import SpeedSource

    model = TiedLM().eval()
    graph = trace(model, torch.randint(0, 50, (2, 8)), tracers=("hooks",))
    src = SpeedSource(get_profile("cpu"), "cpu", this_machine(), "cached calibration", "",
                      cache_dir=tmp_path, measure=True)
    cost = src.cost_model(graph)
    timed = cost.step.optimizer_s
    assert timed is not None and timed > 0
    [cached] = tmp_path.glob("optim-*.json")
    assert cached.name == f"optim-{src.op_times(graph, graph.batch_size).digest}.json"
    assert cost.breakdown(Policy(default="fp32")).parts["optimizer"] == timed
