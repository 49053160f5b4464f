"""PolicyTrainer: HF Trainer under a policy — GradScaler kept, global autocast dropped."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import TrainingArguments  # noqa: E402

from autoprec.errors import InputError  # noqa: E402
from autoprec.integrations.hf import PolicyTrainer  # noqa: E402
from autoprec.policy import Policy, PolicyWarning  # noqa: E402
from tests.helpers import lm_examples as _lm_data  # noqa: E402


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg)


def _cls_data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 100, (8,), generator=g),
             "labels": torch.tensor(i % 2)} for i in range(n)]


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                learning_rate=1e-3, disable_tqdm=True, max_grad_norm=1.0)
    base.update(kw)
    return TrainingArguments(**base)


@pytest.fixture(autouse=True)
def _quiet_policy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # hand-written: no fingerprint
        yield


def test_gpt2_trains_under_fp16_policy_with_scaler_and_no_global_autocast(tmp_path) -> None:
    model = _gpt2()
    before = copy.deepcopy(model.state_dict())
    # Rules on the blocks: a rule on the ModuleList "transformer.h" itself is not applied
    # yet (its forward never runs; the audit reports it).
    policy = Policy(default="fp32", layers={"transformer.h.0": "fp16", "transformer.h.1": "fp16"})
    with pytest.warns(UserWarning, match="global autocast"):
        # fp16=True, as users write it; on CPU accelerate would refuse it outright.
        trainer = PolicyTrainer(model=model, args=_args(tmp_path, fp16=True),
                                train_dataset=_lm_data(), policy=policy)
    assert isinstance(trainer.scaler, torch.amp.GradScaler)
    assert trainer.accelerator.mixed_precision == "no"  # no global autocast

    seen: dict[str, set[torch.dtype]] = {"c_fc": set(), "lm_head": set()}
    hooks = [
        model.transformer.h[0].mlp.c_fc.register_forward_hook(
            lambda m, a, o: seen["c_fc"].add(o.dtype)),
        model.lm_head.register_forward_hook(lambda m, a, o: seen["lm_head"].add(o.dtype)),
    ]
    out = trainer.train()
    for h in hooks:
        h.remove()
    assert trainer.state.global_step == 4
    assert torch.isfinite(torch.tensor(out.training_loss))
    # Inside the fp16 rule: fp16 compute. The default (lm_head) stays fp32: a global fp16
    # autocast would have lowered it.
    assert seen == {"c_fc": {torch.float16}, "lm_head": {torch.float32}}
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs and all(e["loss_scale"] == trainer.loss_scale for e in logs[-1:])
    assert trainer.skipped_steps == logs[-1]["skipped_steps"] == 0
    # Clipping saw unscaled gradients: a norm of a few units, not 65536 times that.
    assert all(e["grad_norm"] < 100 for e in logs)
    trainer.remove_policy()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_bert_bf16_policy_has_no_scaler(tmp_path) -> None:
    model = _bert()
    policy = Policy(default="fp32", layers={"bert.encoder": "bf16"})
    trainer = PolicyTrainer(model=model, args=_args(tmp_path, max_steps=3),
                            train_dataset=_cls_data(), policy=policy)
    assert trainer.scaler is None and trainer.loss_scale is None
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all("loss_scale" not in e for e in trainer.state.log_history)


def test_half_model_refused(tmp_path) -> None:
    model = _bert().half()
    with pytest.raises(InputError, match="fp32 master"):
        PolicyTrainer(model=model, args=_args(tmp_path), train_dataset=_cls_data(),
                      policy=Policy(default="fp32", layers={"bert.encoder": "fp16"}))
