"""A real training step to time and to measure memory on: forward + loss + backward + AdamW.

``training_step(net, forward, loss, batch, fp16=...)`` returns a callable that runs one
step of what a trainer runs — ``zero_grad(set_to_none=True)``, the forward, model.py's
``loss``, ``loss.backward()``, ``AdamW.step()`` — with a ``GradScaler`` where the plan has
fp16 (what ``TrainingArguments(fp16=True)`` runs). It trains ``net``: the timer
(``evaluation.timing.measure_rows``) gives it a copy of the model (timing must not train the
model the tune goes on to write) and applies each plan around it, as the deploy form's
forwards are.

``step_peak_bytes(step)`` measures the allocator's peak during one step on a CPU: torch's
profiler with ``profile_memory`` sees every allocation and free of the CPU allocator (each
op's own, net of its own frees, at the op's start: an op's transient allocations inside
one op are not seen apart); the peak of their running sum, plus what was alive before
(weights, optimizer state after the first step), is the step's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def uses_fp16(policy: Any) -> bool:
    """The plan has an fp16 region: its training runs a GradScaler (only where fp16 runs:
    pytorch#127176)."""
    return policy.default == "fp16" or "fp16" in set(policy.layers.values())


def training_step(net: torch.nn.Module, forward: Callable[[Any, Any], Any],
                  loss: Callable[[Any, Any], torch.Tensor], batch: Any, *,
                  fp16: bool = False, lr: float = 1e-5,
                  optimizer: torch.optim.Optimizer | None = None) -> Callable[[], float]:
    """One training step of ``net`` as a callable returning the loss: AdamW (torch's
    default implementation on the device) over its trainable parameters unless
    ``optimizer`` is given, a GradScaler with ``fp16``. It trains ``net``: time a copy."""
    opt = optimizer or torch.optim.AdamW([p for p in net.parameters() if p.requires_grad],
                                         lr=lr)
    device = next((p.device.type for p in net.parameters()), "cpu")
    scaler = torch.amp.GradScaler(device) if fp16 else None

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        value = loss(forward(net, batch), batch)
        if scaler is not None:
            scaler.scale(value).backward()
            scaler.step(opt)
            scaler.update()
        else:
            value.backward()
            opt.step()
        return float(value.detach())

    step.optimizer = opt  # type: ignore[attr-defined]
    return step


def step_peak_bytes(step: Callable[[], Any], alive_before: int) -> int:
    """Peak bytes of the CPU allocator during one ``step()``: ``alive_before`` (what was
    allocated when it started: weights, gradients kept, optimizer state) plus the highest
    running sum of the step's allocations and frees (torch's profiler, ``profile_memory``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    run = peak = 0
    # each op's own allocations net of its own frees (children apart), and the frees the
    # profiler records on their own ("[memory]"), in the order they happened
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    for e in events:
        run += e.self_cpu_memory_usage
        peak = max(peak, run)
    return alive_before + peak


def live_bytes(model: torch.nn.Module, opt_state: Any = None) -> int:
    """Bytes of the model's parameters, buffers and gradients (distinct storages) and of an
    optimizer's state tensors."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if opt_state is not None:
        for st in opt_state.values():
            tensors += [t for t in st.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


__all__ = ["live_bytes", "step_peak_bytes", "training_step", "uses_fp16"]
