"""A 16-bit model is its own reference (autoprec.workload.reference): bf16 / mixed tiny Llamas.

The error budget binds against the model's own outputs, the policy records ``reference:``,
each layer is offered the precisions at or below its own plus an fp32 island, training
refuses a 16-bit model in one line, a model the device cannot hold twice is refused up
front (exit 2, one line), and tune reports its peak memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from autoprec.apply.apply import apply_policy
from autoprec.errors import InputError
from autoprec.policy import Policy, load_policy
from autoprec.study.objective import given_policy
from autoprec.tuning import prepare as prepare_mod
from autoprec.tuning import tune as tune_mod
from autoprec.tuning.config import TuneConfig
from autoprec.workload.loading import load_model_file
from autoprec.workload.reference import model_reference, offered, own_precision
from autoprec.workload.scoring import reference, score
from tests.cli.test_tune_json_fields import TUNE_JSON_KEYS
from tests.helpers import MODELS, run_cli

BF16 = MODELS / "bf16_llama.py"
MIXED = MODELS / "mixed_llama.py"
DOWN = "model.layers.1.mlp.down_proj"


def test_model_reference_reads_the_dtypes() -> None:
    bf = load_model_file(BF16).model()
    assert model_reference(bf).default == "bf16" and not model_reference(bf).islands
    mixed = model_reference(load_model_file(MIXED).model())
    assert mixed.default == "bf16" and mixed.islands == {DOWN: "fp32"}
    assert given_policy(mixed).layers == {DOWN: "fp32"} and given_policy(mixed).form == "deploy"
    assert model_reference(torch.nn.Linear(4, 4)).is_fp32
    assert own_precision(bf.lm_head) == "bf16"
    got = offered("bf16", ("fp32", "tf32", "bf16", "fp16", "fp8"))
    assert got == ["fp32", "bf16", "fp16", "fp8"]  # tf32 is above a bf16 layer


def _cfg(tmp_path: Path, **kw: object) -> TuneConfig:
    args: dict = dict(max_error=0.01, target="h100", batch_size=64, trials=10,
                      out=tmp_path / "p.yaml", progress=False, cache_dir=tmp_path / "cache")
    args.update(kw)
    return TuneConfig(**args).validated()


def test_space_offers_own_and_lower_plus_fp32_islands(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prep = prepare_mod.prepare(MIXED, cfg)
    space = prepare_mod.make_space(prep, cfg)
    by = {v.name: v.choices for v in space.variables}
    q = by["model.layers.0.self_attn.q_proj"]
    assert "fp32" in q and "bf16" in q and "tf32" not in q  # an island, never tf32
    assert "tf32" in by[DOWN]  # the fp32 module offers everything below fp32
    assert "tf32" not in space.region.choices
    # a mixed model's own layout is measured, not assumed exact: this fp32 module casts
    # its own output back to bf16, which the deploy form's fp32 rule changes
    assert prepare_mod.reference_key(space, prep.reference) is None
    with apply_policy(prep.net, given_policy(prep.reference)):
        assert 0.0 < score(prep.spec, prep.net, prep.calib, prep.ref).error < 0.01


def test_the_bf16_model_as_given_is_exact(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prep = prepare_mod.prepare(BF16, cfg)
    space = prepare_mod.make_space(prep, cfg)
    key = prepare_mod.reference_key(space, prep.reference)
    assert key is not None and set(space.rules(key)[1].values()) == {"bf16"}
    with apply_policy(prep.net, given_policy(prep.reference)):
        assert score(prep.spec, prep.net, prep.calib, prep.ref).error == 0.0


def test_bf16_model_tunes_against_its_own_outputs(tmp_path: Path) -> None:
    res = tune_mod.tune(BF16, target="h100", batch_size=64, trials=10, out=tmp_path / "p.yaml",
                        progress=False, cache_dir=tmp_path / "cache")
    pol = load_policy(tmp_path / "p.yaml")
    assert pol.reference == {"dtype": "bf16"} and pol.form == "deploy"
    assert res.feasible and res.plan.eval_error <= 0.01
    # the error is against the bf16 model's own outputs, recomputed here
    spec = load_model_file(BF16)
    net = spec.model()
    ref = reference(spec, net, spec.eval_batches())
    with torch.no_grad():  # the reference is the bf16 model's own logits, no autocast
        assert spec.forward(net, spec.eval_batches()[0]).dtype == torch.bfloat16
    with apply_policy(net, pol):
        err = score(spec, net, spec.eval_batches(), ref).error
    assert math.isclose(err, res.plan.eval_error, rel_tol=1e-6, abs_tol=1e-9)
    # never priced slower than the bf16 model itself
    assert pol.metrics["est_speedup_over_reference"] >= 1.0
    assert res.costs.peak_memory > res.plan.weight_bytes > 0


def test_old_policies_have_no_reference_and_bad_ones_are_refused() -> None:
    assert Policy(default="bf16").reference == {}
    p = Policy.from_dict({"autoprec_policy": 1, "default": "bf16",
                          "reference": {"dtype": "bf16", "layers": {DOWN: "fp32"}}})
    assert p.to_dict()["reference"] == {"dtype": "bf16", "layers": {DOWN: "fp32"}}
    with pytest.raises(Exception, match="reference.dtype: must be one of fp32, bf16, fp16"):
        Policy.from_dict({"autoprec_policy": 1, "default": "bf16",
                          "reference": {"dtype": "fp8"}})


def test_training_refuses_a_16_bit_model(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from autoprec.training.train import fidelity_check_spec

    spec = load_model_file(BF16)
    spec.loss = lambda out, batch: out.float().mean()  # type: ignore[assignment]
    with pytest.raises(InputError, match="needs fp32 master weights"):
        fidelity_check_spec(spec, Policy(default="bf16"), steps=1)
    code, _out, err = run_cli(["tune", str(BF16), "--form", "train", "--no-track", "--quiet",
                               "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "fp32 master weights, but the model is bf16" in err


def test_a_model_the_device_cannot_hold_twice_is_refused_up_front(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(["tune", str(BF16), "--memory-limit", "0.0005", "--no-track",
                               "--quiet", "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "a tune holds them twice" in err and "--memory-limit" in err
    assert not (tmp_path / "p.yaml").exists()


def test_peak_memory_is_in_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["tune", str(MIXED), "--target", "h100", "--batch-size", "64",
                              "--trials", "5", "--json", "--no-track",
                              "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert list(got) == [*TUNE_JSON_KEYS, "batch_size_from"]  # the keys, in order
    assert got["peak_memory_bytes"] > got["model_weight_bytes"] > 0
    stages = got["memory_stages"]  # each stage's own peak (autoprec.tuning.memory.StagePeaks)
    assert list(stages) == ["load", "reference", "trace", "probe", "search",
                            "confirm"]
    assert all(v > 0 for v in stages.values()), stages
    assert got["peak_memory_bytes"] == max(stages.values())
    assert got["peak_memory_stage"] == max(stages, key=stages.__getitem__)
    assert got["reference"] == {"dtype": "bf16", "layers": {DOWN: "fp32"}}
    assert got["est_speedup_over_reference"] >= 1.0


def test_when_no_plan_fits_the_note_says_why_per_layer(tmp_path: Path) -> None:
    """A budget no lowered plan meets: the model as given is written, and the note names the
    closest trial's error and, per precision, the layers that cost least alone."""
    res = tune_mod.tune(BF16, _cfg(tmp_path, max_error=1e-6, precisions="bf16,fp8",
                                   trials=3))
    assert not res.policy.layers and res.policy.default == "bf16"
    (note,) = [n for n in res.plan.notes if n.startswith("no trial found a plan within budget")]
    assert "the closest of " in note and "(budget 1e-06)" in note
    assert "fp8 alone costs at least " in note and "model.layers." in note
