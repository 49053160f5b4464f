"""The Python API for the model in hand (issue 48), as a notebook would use it: an HF model
built in code and a DataLoader over real text, tuned, applied, checked and evaluated from
Python with no model.py; and the checks model.py's data gets, for objects."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import autoprec
from autoprec.errors import InputError

L = 16  # tokens per sentence


def _sentences() -> list[tuple[str, int]]:
    """Real English: the descriptions scikit-learn bundles with three data sets, split into
    sentences, each labelled with the data set it describes."""
    from sklearn import datasets

    out = []
    for label, load in enumerate((datasets.load_iris, datasets.load_digits,
                                  datasets.load_wine)):
        for s in re.split(r"[.\n]\s*\n|\.\s", load().DESCR):
            if len(s.split()) >= 4:
                out.append((s, label))
    return out


def _loaders() -> tuple[DataLoader[Any], DataLoader[Any], int]:
    """Word-level token ids of the sentences, as dict batches (``model(**batch)``)."""
    texts = _sentences()
    words = sorted({w for s, _ in texts for w in re.findall(r"[a-z]+", s.lower())})
    vocab = {w: i + 2 for i, w in enumerate(words)}  # 0: padding, 1: [CLS]

    def encode(s: str) -> dict[str, torch.Tensor]:
        ids = [1] + [vocab[w] for w in re.findall(r"[a-z]+", s.lower())][:L - 1]
        mask = [1] * len(ids) + [0] * (L - len(ids))
        return {"input_ids": torch.tensor(ids + [0] * (L - len(ids))),
                "attention_mask": torch.tensor(mask)}

    rows = [encode(s) for s, _ in texts]
    return (DataLoader(rows[0::2], batch_size=16), DataLoader(rows[1::2], batch_size=16),
            len(vocab) + 2)


def _bert(vocab_size: int) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(config)  # in train mode, as built


def _relative_l2(model: nn.Module, policy: autoprec.Policy, loader: DataLoader[Any]) -> float:
    """The error as docs/overview.md defines it, computed here with apply_policy alone."""
    model.eval()
    with torch.no_grad():
        refs = [model(**b).logits for b in loader]
        with autoprec.apply_policy(model, policy):
            outs = [model(**b).logits.float() for b in loader]
    num = sum(float((o - r).pow(2).sum()) for o, r in zip(outs, refs, strict=True))
    den = sum(float(r.pow(2).sum()) for r in refs)
    return math.sqrt(num / den)


@pytest.mark.slow
def test_an_hf_model_and_a_dataloader_are_tuned_applied_checked_and_evaluated(
        tmp_path: Path) -> None:
    calibration, held_out, vocab_size = _loaders()
    model = _bert(vocab_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    modules = dict(model.named_modules())

    result = autoprec.tune(model, calibration=calibration, eval=held_out, max_error=0.02,
                           target="h100", batch_size=1024, trials=10, locked=["classifier"],
                           out=tmp_path / "bert.yaml", cache_dir=tmp_path / "cache",
                           progress=False, tracker=None)

    # no file but the outputs: the policy, the study, the probe cache
    assert not list(tmp_path.rglob("*.py"))
    assert isinstance(result, autoprec.TuneResult)
    assert result.path == tmp_path / "bert.yaml" and result.feasible
    # the model as given: weights, parameter objects and its train mode are untouched
    assert model.training and all(m.training for m in model.modules())
    assert [id(p) for p in model.parameters()] == params
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    policy = autoprec.load_policy(result.path, model=model)
    assert policy.model_name == "BertForSequenceClassification"  # name's default
    assert policy.default != "fp32" and policy.layers["classifier"] == "fp32"  # --lock
    assert set(policy.layers) | set(policy.reasons) <= set(modules)  # real module paths

    # the gate, from Python: within budget, and the error one computes with apply_policy
    verdict = autoprec.check(model, policy, calibration=calibration, eval=held_out)
    assert verdict.passed, verdict.reasons
    assert 0 < verdict.error <= policy.metrics["budget"] == 0.02
    gemms = {row["layer"]: row for row in verdict.layers}
    assert set(gemms) <= set(modules) and "bert.encoder.layer.1.output.dense" in gemms
    assert all(row["computed"] == row["precision"] for row in gemms.values())
    assert gemms["classifier"]["precision"] == "fp32"
    independent = _relative_l2(model, policy, held_out)
    assert independent == pytest.approx(verdict.error, rel=0.05)
    assert independent == pytest.approx(policy.metrics["error"], rel=0.05)  # tune's own

    report = autoprec.evaluate(model, policy, calibration=calibration, eval=held_out)
    assert report.error == pytest.approx(verdict.error, rel=1e-9)
    assert report.feasible and report.est_speedup == pytest.approx(verdict.est_speedup)
    assert report.to_dict()["model"] == "BertForSequenceClassification"
    model.train()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=gen) for _ in range(3)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "tune: calibration= is required with a model in hand"),
    ({"calibration": torch.randn(8, 16)},
     r"tune: calibration is one tensor of shape \(8, 16\); return a list of batches"),
    ({"calibration": {"x": torch.randn(8, 16)}}, "tune: calibration is a dict"),
    ({"calibration": 3}, "tune: calibration is a int, not an iterable of batches"),
    ({"calibration": []}, "tune: calibration yielded no batches"),
    ({"calibration": (torch.randn(8, 16) for _ in itertools.count())},
     "tune: calibration yields more than 1000 batches"),
    ({"calibration": [torch.randn(8, 16), torch.randn(0, 16)]},
     r"tune: batch 1 of calibration has 0 rows \(shape \(0, 16\)\)"),
    ({"calibration": [torch.randn(8, 16)], "eval": torch.randn(8, 16)},
     "tune: eval is one tensor"),
    ({"calibration": [torch.randn(8, 16)], "name": "../up"}, "tune: name must be a plain"),
    ({"calibration": [torch.randn(8, 16)], "forward": "model(x)"},
     "tune: forward must be a function, got str"),
    ({"calibration": [torch.randn(8, 16)], "max_drop": 0.01},
     "tune: max_drop is a drop of the metric: give metric="),
])
def test_bad_data_for_a_model_in_hand_is_one_line_naming_the_argument(
        kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=message) as err:
        autoprec.tune(_Net(), out=tmp_path / "p.yaml", **kwargs)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())  # refused before any work


def test_a_tune_config_built_beforehand_is_checked_once_before_any_work(
        tmp_path: Path) -> None:
    config = autoprec.TuneConfig(max_drop=0.01, target="H100", out=tmp_path / "p.yaml")
    with pytest.raises(autoprec.AutoprecError, match="tune: max_drop is a drop of the metric"):
        autoprec.tune(_Net(), config, calibration=_batches())
    with pytest.raises(InputError, match="unknown target device .h1000.; known devices: "):
        autoprec.tune(_Net(), autoprec.TuneConfig(target="h1000"), calibration=_batches())
    with pytest.raises(TypeError, match="give a TuneConfig or its options, not both"):
        autoprec.tune(_Net(), autoprec.TuneConfig(), calibration=_batches(), trials=3)
    assert not list(tmp_path.iterdir())


def test_the_model_and_its_data_come_from_one_place(tmp_path: Path) -> None:
    from tests.helpers import TRAP

    with pytest.raises(InputError, match="calibration go with a model in hand"):
        autoprec.tune(TRAP, calibration=_batches(), out=tmp_path / "p.yaml")
    with pytest.raises(InputError, match="model must be a torch.nn.Module, the path of a "
                                         "model.py or a ModelSpec, got dict"):
        autoprec.check({"a": 1}, autoprec.Policy(default="bf16"))
    scripted = torch.jit.script(_Net())
    with pytest.raises(InputError, match="evaluate: model is a TorchScript module"):
        autoprec.evaluate(scripted, autoprec.Policy(default="bf16"), calibration=_batches())
    double = _Net().double()
    with pytest.raises(InputError, match="parameter 'a.weight' is float64"):
        autoprec.check(double, autoprec.Policy(default="bf16"), calibration=_batches())


def test_a_generator_is_read_once_and_every_stage_sees_the_same_batches() -> None:
    from autoprec.workload.inputs import spec_of

    data = _batches()
    spec = spec_of(_Net(), calibration=(x for x in data))  # a one-shot iterator
    assert spec.calibration_batches() == data and spec.eval_batches() == data
    assert spec.path is None and spec.name == "_Net" and spec.where == "model '_Net'"


def test_the_probe_cache_of_a_model_in_hand_is_keyed_by_its_weights_and_data(
        tmp_path: Path) -> None:
    """A model with no file: the probe cache key hashes the weights' and the batches'
    values, so a changed weight or batch is a new key, the same ones a hit."""
    model = _Net()
    loader = DataLoader(torch.cat(_batches()), batch_size=8)  # tensor rows -> batches

    def probed(net: nn.Module, data: Any) -> Any:
        return autoprec.probe_model(net, data, ["bf16"], cache_dir=tmp_path, progress=False,
                                    e2e="none")

    first = probed(model, loader)
    assert not first.meta["cached"] and probed(model, loader).meta["cached"]
    other = [b + 1 for b in loader]
    assert not probed(model, other).meta["cached"]
    with torch.no_grad():
        model.a.weight[0, 0] += 1e-3
    assert not probed(model, loader).meta["cached"]
    with pytest.raises(InputError, match=r"probe: calibration is one tensor of shape"):
        probed(model, torch.randn(8, 16))


def test_trace_and_probe_take_the_model_and_a_dataloader() -> None:
    model = _Net().train()
    loader = DataLoader(torch.cat(_batches()), batch_size=8)
    graph = autoprec.trace_model(model, next(iter(loader)))
    assert [n.path for n in graph.gemm_nodes] == ["a", "b"]
    table = autoprec.probe_model(model, loader, ["bf16"], progress=False, e2e="none")
    assert set(table.to_frame()["layer"]) == {"a", "b"}
    assert model.training  # handed back in the mode it came


def test_apply_policy_groups_its_rarely_needed_settings() -> None:
    model, x = _Net(), torch.randn(4, 16)
    events: list[Any] = []
    policy = autoprec.Policy(default="fp16", form="deploy")
    with autoprec.apply_policy(model, policy, guard="detect",
                               options=autoprec.ApplyOptions(device="cpu",
                                                             on_event=events.append)) as h:
        assert isinstance(h, autoprec.PolicyHandle) and h.form == "deploy" and model(x).dtype == torch.float16
        model(x * 1e6)  # overflows fp16
    assert events and {e.layer for e in events} <= {"a", "b"}
    with pytest.raises(TypeError):
        autoprec.apply_policy(model, policy, "emulated")  # type: ignore[misc]


def test_python_errors_name_the_keyword_arguments_not_the_cli_flags(tmp_path: Path) -> None:
    from autoprec.policy import Policy
    from tests.helpers import TRAP

    with pytest.raises(InputError, match=r"^max_error: must be") as err:
        autoprec.tune(TRAP, max_error=-1.0, out=tmp_path / "p.yaml")
    assert "--" not in str(err.value)
    with pytest.raises(InputError, match=r"^form must be one of") as err:
        autoprec.tune(TRAP, form="serve", out=tmp_path / "p.yaml")
    pol = tmp_path / "other.yaml"
    Policy(default="bf16", model={"fingerprint": "sha256:" + "0" * 64}).save(pol)
    with pytest.raises(InputError, match=r"force it \(force=True\)$") as err:
        autoprec.evaluate(TRAP, pol)
    assert "--force" not in str(err.value)
    verdict = autoprec.check(TRAP, pol, force=True)  # a note, not a failure: its words
    assert any("accepted (force=True)" in n for n in verdict.notes), verdict.notes


def test_progress_false_shows_no_bar_for_a_model_py(tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """A fresh folder (no probe cache): the probes run, and print no bar."""
    from tests.helpers import TRAP

    autoprec.tune(TRAP, target="h100", trials=1, out=tmp_path / "p.yaml", progress=False)
    err = capfd.readouterr().err
    assert "probe:" not in err and "it/s" not in err and "batch/s" not in err, err[-2000:]
    assert (tmp_path / ".autoprec" / "probe-cache").is_dir()  # the probes did run
