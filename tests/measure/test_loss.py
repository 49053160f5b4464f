"""``record_loss`` with the HuggingFace loss idiom: ``loss=lambda out, batch: out.loss`` with
the labels in the batch. The model computes that loss inside its forward (its kernels are
the forward's, priced with it), so nothing more runs after the output: no loss kernels, and
no refusal for a loss "with no gradient"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoprec.cost.loss_step import OUTPUT_DTYPES
from autoprec.measure import record_loss
from autoprec.workload.loading import ModelSpec, default_forward

pytest.importorskip("transformers")


def _gpt2_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(cfg).eval(), {"input_ids": ids, "labels": ids}


def _checked(model: torch.nn.Module, batch: dict, loss) -> ModelSpec:  # noqa: ANN001
    """model.py's loss as every stage calls it: wrapped by ModelSpec's checks."""
    return ModelSpec(path=None, name="gpt2", build_model=lambda: model,
                     calibration_data=lambda: [batch], loss=loss)


def test_the_models_own_loss_is_accepted_and_adds_no_kernels() -> None:
    model, batch = _gpt2_and_batch()
    spec = _checked(model, batch, lambda out, b: out.loss)
    got = record_loss(model, default_forward, spec.loss, batch, measure=True)
    assert set(got.kernels) == set(OUTPUT_DTYPES)
    assert all(ks == [] for ks in got.kernels.values())
    assert all(s == 0.0 for s in got.seconds.values())


def test_a_loss_from_the_logits_still_records_its_kernels() -> None:
    model, batch = _gpt2_and_batch()

    def ce(out, b):  # noqa: ANN001, ANN202
        return F.cross_entropy(out.logits.flatten(0, 1).float(), b["labels"].flatten())

    got = record_loss(model, default_forward, _checked(model, batch, ce).loss, batch)
    names = {k.name for k in got.kernels["bf16"]}
    assert {"_log_softmax", "nll_loss_forward"} <= names, names
    assert any(k.phase == "backward" for k in got.kernels["fp32"])


def test_a_detached_loss_of_the_logits_is_still_refused() -> None:
    """What the gradient check is for: a loss computed from the outputs, then detached."""
    from autoprec.errors import ModelFileError

    model, batch = _gpt2_and_batch()

    def detached(out, b):  # noqa: ANN001, ANN202
        return out.logits.float().pow(2).mean().detach()

    spec = _checked(model, batch, detached)
    with pytest.raises(ModelFileError, match="no gradient"):
        record_loss(model, default_forward, spec.loss, batch)
