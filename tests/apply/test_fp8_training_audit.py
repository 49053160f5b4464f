"""The train form's fp8 leaves run fprop, dgrad and wgrad in fp8 through torchao, proven on
a real forward + backward (``audit_fp8_training``), and train as the emulation does."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchao.float8")
pytest.importorskip("transformers")

from autoprec.apply.apply import apply_policy  # noqa: E402
from autoprec.apply.audit import AuditError  # noqa: E402
from autoprec.apply.fp8_training_audit import audit_fp8_training  # noqa: E402
from autoprec.device.capability import torchao_fp8_kernels  # noqa: E402
from autoprec.errors import InputError  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.training.train import prepare_training, train_step  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=2,
                                      n_positions=32, bos_token_id=0, eos_token_id=0))


def _bert(dropout: float = 0.1) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=128,
                                      max_position_embeddings=32, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=dropout))


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("build", "container"), [(_gpt2, "transformer.h"),
                                                  (_bert, "bert.encoder")])
@pytest.mark.parametrize("backend", ["torchao", "torchao-rowwise"])
def test_every_fp8_leaf_ran_three_fp8_gemms_through_torchao(build, container, backend) -> None:
    model = build()
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "bf16",
                               "layers": {container: "fp8"}})
    with apply_policy(model, policy, fp8_backend=backend, form="train") as h:
        assert h.fp8_backend == backend and "emulate=True" in h.fp8_reason
        report = audit_fp8_training(h, lambda: model(IDS, labels=IDS).loss)
    n_linear = 4 if container == "transformer.h" else 6  # GEMM leaves per block
    assert len(report.leaves) == 2 * n_linear and report.ok, report.table()
    want = ("e5m2", "e4m3") if backend == "torchao" else ("e4m3", "e4m3")
    for leaf in report.leaves:
        assert report.gemms[leaf] == {"fprop": ("e4m3", "e4m3"), "dgrad": want,
                                      "wgrad": want}
        assert report.calls[leaf] == 3
        assert report.casts[leaf] == 6  # x, W forward; dY, W for dgrad; dY, x for wgrad
    assert report.emulated  # this CPU has no fp8 kernels
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_leaf_that_never_ran_is_an_error() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    model.forward = lambda x: model[0](x)  # type: ignore[method-assign]
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "fp32", "layers": {"": "fp8"}})
    x = torch.randn(8, 32)
    with apply_policy(model, policy, fp8_backend="torchao", form="train") as h:
        report = audit_fp8_training(h, lambda: model(x).sum(), strict=False)
        assert [e.split(":")[0] for e in report.errors] == ["1", "1", "1"]
        with pytest.raises(AuditError, match="1: no fprop GEMM ran in fp8 through torchao"):
            audit_fp8_training(h, lambda: model(x).sum())


def test_emulated_backend_is_refused_by_the_library_audit() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "fp32", "layers": {"": "fp8"}})
    with apply_policy(model, policy, fp8_backend="emulated", form="train") as h, \
            pytest.raises(InputError, match="backend 'emulated'"):
        audit_fp8_training(h, lambda: model(torch.randn(4, 32)).sum())


def test_deploy_form_refuses_the_torchao_backend() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "fp32", "layers": {"": "fp8"}})
    with pytest.raises(InputError, match="train form"):
        apply_policy(model, policy, fp8_backend="torchao", form="deploy")


def test_training_through_torchao_is_the_emulations_training() -> None:
    """Five AdamW steps on a BERT with fp8 FFNs in fp32 regions: the torchao backend and the
    home-made emulation give the same losses and weights bit for bit (one recipe)."""
    a = _bert(dropout=0.0)
    b = copy.deepcopy(a)
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "fp32",
                               "layers": {"bert.encoder.layer.0.intermediate": "fp8",
                                          "bert.encoder.layer.1.output.dense": "fp8"}})
    losses = {}
    for name, model, backend in (("ao", a, "torchao"), ("emu", b, "emulated")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with prepare_training(model, policy, fp8_backend=backend) as setup:
            assert setup.handle.fp8_backend == backend
            assert setup.report()["format_backends"] == {"fp8": backend}
            losses[name] = [train_step(setup, opt, {"input_ids": IDS, "labels": IDS},
                                       lambda out, batch: out.loss).loss for _ in range(5)]
    assert losses["ao"] == losses["emu"] and losses["ao"][-1] < losses["ao"][0]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_torch_compile_traces_the_torchao_backend_without_graph_breaks() -> None:
    """The library modules are built at apply time: a compiled forward + backward (dynamo,
    aot_eager: the graph torch.compile would hand inductor) equals the eager one."""
    import torch._dynamo

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 32))
    compiled = copy.deepcopy(eager)
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "bf16", "layers": {"": "fp8"}})
    x = torch.randn(8, 64)
    with apply_policy(eager, policy, fp8_backend="torchao", form="train"):
        y0 = eager(x)
        y0.float().sum().backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with apply_policy(compiled, policy, fp8_backend="torchao", form="train"):
        y = torch.compile(compiled, backend="aot_eager")(x)
        y.float().sum().backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(y, y0)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.skipif(not torchao_fp8_kernels("torchao")[0],
                    reason=torchao_fp8_kernels("torchao")[1])
def test_on_an_fp8_gpu_the_train_form_runs_torchaos_kernels() -> None:  # pragma: no cover
    from autoprec.device.capability import best_fp8_backend

    if best_fp8_backend("cuda", training=True)[0] != "torchao":
        pytest.skip("Transformer Engine runs here: the train form picks it first")
    model = _gpt2().cuda()
    policy = Policy.from_dict({"autoprec_policy": 1, "default": "bf16",
                               "layers": {"transformer.h": "fp8"}})
    ids = IDS.cuda()
    with apply_policy(model, policy, form="train") as h:  # no backend named: the default
        assert h.fp8_backend == "torchao"
        report = audit_fp8_training(h, lambda: model(ids, labels=ids).loss)
    assert report.ok and report.emulated is False
