"""What a trainer uses, under a policy: HF Trainer with gradient accumulation and
torch_compile, a plain accelerate loop, skipped fp16 steps counted and reported."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from autoprec.errors import InputError  # noqa: E402
from autoprec.integrations.accel import use_accelerator  # noqa: E402
from autoprec.integrations.hf import PolicyTrainer  # noqa: E402
from autoprec.policy import Policy, PolicyWarning  # noqa: E402
from autoprec.training.loss_scaler import CountingGradScaler  # noqa: E402
from autoprec.training.train import prepare_training  # noqa: E402
from tests.helpers import lm_examples as _lm_data  # noqa: E402

FP16 = Policy(default="fp32", layers={"transformer.h.0": "fp16", "transformer.h.1": "fp16"})
BF16 = Policy(default="fp32", layers={"transformer.h": "bf16"})


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps its state in process-wide singletons: each test starts clean."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # hand-written: no fingerprint
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        yield
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=32, use_cache=False, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                learning_rate=1e-2, disable_tqdm=True, max_grad_norm=1.0, optim="sgd",
                dataloader_drop_last=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


# -- HF Trainer ------------------------------------------------------------------------


def test_gradient_accumulation_steps_once_per_optimizer_step(tmp_path) -> None:
    """2 micro-batches of 2 under an fp16 policy: the loss is scaled on each, the scaler
    steps once per optimizer step, and the update is the one of a batch of 4."""
    acc_model, big_model = _gpt2(), _gpt2()
    acc = PolicyTrainer(model=acc_model, policy=FP16, train_dataset=_lm_data(),
                        args=_args(tmp_path, per_device_train_batch_size=2,
                                   gradient_accumulation_steps=2, max_steps=3))
    out = acc.train()
    big = PolicyTrainer(model=big_model, policy=FP16, train_dataset=_lm_data(),
                        args=_args(tmp_path, per_device_train_batch_size=4, max_steps=3))
    big.train()
    assert acc.state.global_step == 3
    assert isinstance(acc.scaler, CountingGradScaler) and acc.scaler.steps == 3
    assert out.metrics["train_optimizer_steps"] == 3 and out.metrics["train_skipped_steps"] == 0
    start = _gpt2().state_dict()
    for (name, p), q in zip(acc_model.named_parameters(), big_model.parameters()):
        moved = (q.detach() - start[name]).abs().max()
        if moved > 0:  # the same update, up to fp16 rounding of the two batch splits
            assert (p.detach() - q.detach()).abs().max() <= 0.02 * moved, name
    acc.remove_policy()
    big.remove_policy()


def test_skipped_fp16_steps_are_counted_logged_and_in_the_metrics(tmp_path) -> None:
    """A first scale of 2**40 overflows the scaled fp16 gradients: the first steps are
    skipped (the weights do not move), counted, logged and reported in train()'s metrics."""
    model = _gpt2()
    before = copy.deepcopy(model.state_dict())
    trainer = PolicyTrainer(model=model, policy=FP16, train_dataset=_lm_data(),
                            args=_args(tmp_path, max_steps=3), init_scale=2.0**40)
    out = trainer.train()
    assert trainer.skipped_steps == 3 and out.metrics["train_skipped_steps"] == 3
    assert out.metrics["train_loss_scale"] == 2.0**37
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["skipped_steps"] for e in logs] == [1.0, 2.0, 3.0]
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    trainer.remove_policy()


def test_policy_trainer_trains_fp8_layers_through_torchao(tmp_path) -> None:
    """fp8 blocks under a bf16 default, fp8_backend="torchao": Trainer's steps run the
    library's Float8Linear GEMMs (emulated on this CPU) and update the fp8 layers."""
    pytest.importorskip("torchao.float8")
    from autoprec.lower.torchao_fp8 import CACHE_ATTR

    model = _gpt2()
    before = copy.deepcopy(model.state_dict())
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "bf16",
                               "layers": {"transformer.h": "fp8"}})
    trainer = PolicyTrainer(model=model, policy=policy, train_dataset=_lm_data(),
                            args=_args(tmp_path, max_steps=2), fp8_backend="torchao")
    assert trainer.policy_handle.format_backends == {"fp8": "torchao"}
    assert trainer.scaler is None  # no fp16 layer: no loss scaling
    trainer.train()
    c_fc = model.transformer.h[0].mlp.c_fc
    assert CACHE_ATTR in c_fc.__dict__  # the library path ran for this leaf
    assert not torch.equal(c_fc.weight.detach(), before["transformer.h.0.mlp.c_fc.weight"])
    trainer.remove_policy()
    assert CACHE_ATTR not in c_fc.__dict__


@pytest.mark.slow
def test_torch_compile_trains_the_policy(tmp_path) -> None:
    """torch_compile=True compiles the policy-applied model: the same losses as the eager
    policy run, not fp32's (the bf16 regions ran inside the compiled graph)."""
    runs = {}
    for name, policy, compile_ in (("compiled", BF16, True), ("eager", BF16, False),
                                   ("fp32", Policy(default="fp32"), False)):
        AcceleratorState._reset_state(True)
        trainer = PolicyTrainer(model=_gpt2(), policy=policy, train_dataset=_lm_data(),
                                args=_args(tmp_path, max_steps=3, torch_compile=compile_,
                                           torch_compile_backend="inductor"))
        trainer.train()
        runs[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        if compile_:
            assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) \
                or isinstance(trainer.accelerator._models[0],
                              torch._dynamo.eval_frame.OptimizedModule)
        trainer.remove_policy()
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=2e-3)
    assert runs["compiled"] != pytest.approx(runs["fp32"], rel=1e-5)


# -- a plain accelerate loop -------------------------------------------------------------


def _accelerate_loop(policy: Policy, init_scale: float = 2.0**16, steps: int = 3,
                     accumulation: int = 2
                     ) -> tuple[torch.nn.Module, object, list[float], list[bool]]:
    """The loop of ``autoprec.integrations.accel``'s docstring, on a tiny GPT-2."""
    model = _gpt2()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    setup = prepare_training(model, policy, init_scale=init_scale)
    use_accelerator(accelerator, setup)
    loader = torch.utils.data.DataLoader(_lm_data(2 * steps * accumulation), batch_size=2)
    pmodel, opt, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=1e-2), loader)
    losses, skipped = [], []  # skipped: accelerate's own verdict per optimizer step
    for batch in loader:
        with accelerator.accumulate(pmodel):
            loss = pmodel(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(pmodel.parameters(), 1.0)
            opt.step()
            if accelerator.sync_gradients:
                skipped.append(opt.step_was_skipped)
            opt.zero_grad()
        losses.append(float(loss))
    setup.remove()
    return model, setup, losses, skipped


def test_accelerate_loop_under_an_fp16_policy() -> None:
    start = _gpt2().state_dict()
    model, setup, losses, skipped = _accelerate_loop(FP16)
    assert skipped == [False] * 3
    assert setup.scaler is not None and setup.steps == 3  # 6 micro-batches / 2
    report = setup.report()
    assert report["skipped_steps"] == 0 and report["loss_scale"] == 2.0**16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(p.detach(), start[n]) for n, p in model.named_parameters()
               if n.startswith("transformer.h"))


def test_accelerate_loop_counts_skipped_steps() -> None:
    model0 = _gpt2()
    model, setup, _, skipped = _accelerate_loop(FP16, init_scale=2.0**30, steps=16,
                                                accumulation=1)
    # the scale halves on each overflow (and only then: 16 steps are too few to grow it)
    n = setup.skipped_steps
    assert setup.steps == 16 and 1 <= n < 16 and skipped[0]
    assert n == sum(skipped)  # the scaler's count is accelerate's own verdict
    assert setup.scale == 2.0 ** (30 - n)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), model0.parameters()))


def test_accelerate_clipping_sees_unscaled_gradients() -> None:
    """accelerate unscales only for its own fp16; without the hand-over it would clip
    gradients 65536 times too large (a norm of ~1e5, every step clipped to noise)."""
    model = _gpt2()
    accelerator = Accelerator(cpu=True)
    setup = prepare_training(model, FP16)
    use_accelerator(accelerator, setup)
    pmodel, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    batch = torch.utils.data.default_collate(_lm_data(2))
    accelerator.backward(pmodel(**batch).loss)
    norm = float(accelerator.clip_grad_norm_(pmodel.parameters(), 1e9))
    assert 0 < norm < 100
    setup.remove()


def test_accelerator_with_a_global_autocast_is_refused() -> None:
    model = _gpt2()
    setup = prepare_training(model, BF16)
    with pytest.raises(InputError, match="mixed_precision='bf16'.*overrides the policy"):
        use_accelerator(Accelerator(cpu=True, mixed_precision="bf16"), setup)
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.optim.SGD(model.parameters(), lr=1e-2))
    with pytest.raises(InputError, match="before accelerator.prepare"):
        use_accelerator(accelerator, setup)
    setup.remove()


def test_the_documented_accelerate_loop_runs_as_written(capsys) -> None:
    import re

    from tests.helpers import ROOT

    text = (ROOT / "docs" / "training.md").read_text()
    start = text.index("\n## 4. Training loops and fp8 training\n")
    section = text[start:text.find("\n## ", start + 1)]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    exec(compile(code, "docs/training.md (accelerate loop)", "exec"), {})
    report = eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["skipped_steps"] == 0  # 4 micro-batches / 2
    assert report["loss_scale"] == 2.0**16 and report["format_backends"] == {}
