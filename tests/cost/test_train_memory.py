"""The training step's memory estimate (``cost.train_memory`` via ``StepPart``) against
the CPU allocator's measured peak of a real step (``measure.train_steps.step_peak_bytes``:
torch's profiler, ``profile_memory``) — weights, gradients, AdamW state and the activations
saved for the backward, for fp32 and one global bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoprec.apply.apply import apply_policy
from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import ADAMW_FOREACH, StepPart
from autoprec.measure.train_steps import live_bytes, step_peak_bytes, training_step
from autoprec.policy import Policy
from autoprec.trace import trace

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                     use_cache=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval(), torch.randint(0, 256, (4, 64))  # ids (B, T)


def _fwd(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(input_ids=b).logits  # (B, T, V)


def _loss(out: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), b.flatten())


@pytest.mark.parametrize("default", ["fp32", "bf16"])
def test_estimated_peak_is_within_15_percent_of_the_measured_step(default: str) -> None:
    model, ids = _gpt2()
    cost = CostModel(trace(model, ids, forward=_fwd, tracers=("hooks",)),
                         get_profile("cpu"), step=StepPart(optimizer=ADAMW_FOREACH))
    pol = Policy(default=default)
    step = training_step(model, _fwd, _loss, ids)
    with apply_policy(model, pol, target="cpu"):
        step()  # AdamW's state exists from the first step on
        model.zero_grad(set_to_none=True)
        measured = step_peak_bytes(step, live_bytes(model, step.optimizer.state))
    est = cost.train_memory(pol)
    n = sum(p.numel() for p in model.parameters())
    assert est.weights == est.grads == 4 * n and est.optimizer == 8 * n
    assert est.peak_bytes == pytest.approx(measured, rel=0.15)


def test_bf16_saves_less_than_fp32_and_fp8_saves_its_1_byte_copy() -> None:
    model, ids = _gpt2()
    cost = CostModel(trace(model, ids, forward=_fwd, tracers=("hooks",)), get_profile("h100"), step=StepPart())
    fp32 = cost.train_memory(Policy(default="fp32")).activations
    bf16 = cost.train_memory(Policy(default="bf16")).activations
    fp8 = cost.train_memory(Policy(default="bf16", layers={"transformer.h.0.mlp.c_fc": "fp8"}))
    assert bf16 < fp32
    assert fp8.activations < bf16  # c_fc saves its e4m3 input (1 byte), not a bf16 copy
    assert fp8.weights > cost.train_memory(Policy(default="bf16")).weights  # + the e4m3 weight
