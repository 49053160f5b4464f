"""``tune --fuse-groups auto``: a fused runtime's groups are one variable of the search, so
every trial, the written policy and the export give them one precision; ``off`` leaves
them free (on ``fused_llama`` the layer-0 gate/up then differ: up_proj overflows fp16)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from autoprec.plan import compile_plan
from autoprec.policy import load_policy
from autoprec.search.space import build_space
from tests.helpers import MODELS, run_cli

MODEL = MODELS / "fused_llama.py"
GU = ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")


def test_the_space_ties_a_group_into_one_variable() -> None:
    layers = ["a.q", "a.k", "a.v", "a.o"]
    allowed = {p: ["bf16", "fp16", "fp8"] for p in layers}
    excluded = {"a.k": {"fp8": "fp8: underflow"}}
    free = build_space(layers, allowed, excluded, ["fp32", "bf16", "fp16", "fp8"])
    assert [v.layers for v in free.variables] == [["a.q"], ["a.k"], ["a.v"], ["a.o"]]
    tied = build_space(layers, allowed, excluded, ["fp32", "bf16", "fp16", "fp8"],
                       fused=[["a.q", "a.k", "a.v"]])
    assert [v.layers for v in tied.variables] == [["a.q", "a.k", "a.v"], ["a.o"]]
    assert tied.variables[0].name == "a.{q,k,v}"
    assert "fp8" not in tied.variables[0].choices  # what every member allows
    assert tied.reasons()["a.q"] == "fp8: a.k (one fused group): underflow"
    _, rules = tied.rules(tied.uniform("fp16"))
    assert rules["a.q"] == rules["a.k"] == rules["a.v"] == "fp16"


def _tune(tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / mode / "p.yaml"
    code, _, err = run_cli(["tune", MODEL, "--target", "h100", "--batch-size", "1024",
                            "--precisions", "fp32,fp16", "--max-error", "0.05",
                            "--trials", "20", "--fuse-groups", mode, "--no-track",
                            "--quiet", "--out", out], capsys, quiet_warnings=True)
    assert code == 0, err
    return out


def _trials(out: Path) -> list[optuna.trial.FrozenTrial]:
    url = f"sqlite:///{out.parent / 'studies' / 'fusedllama.db'}"
    (summary,) = optuna.get_all_study_summaries(url)
    return optuna.load_study(study_name=summary.study_name, storage=url).trials


@pytest.mark.slow
def test_fuse_groups_auto_and_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autoprec.workload.loading import load_model_file

    model = load_model_file(MODEL).model()
    groups = [(f"model.layers.{i}.self_attn.{{q_proj,k_proj,v_proj}}",
               f"model.layers.{i}.mlp.{{gate_proj,up_proj}}") for i in range(2)]

    auto = _tune(tmp_path, "auto", capsys)
    trials = _trials(auto)
    assert trials
    for t in trials:  # one variable per group in every trial: no member has its own
        for qkv, gu in groups:
            assert qkv in t.params and gu in t.params
        assert not any(k.endswith((".q_proj", ".gate_proj", ".up_proj")) for k in t.params)
    pol = load_policy(auto, model=model)
    prec = compile_plan(pol, model).assignment([*GU, "model.layers.0.self_attn.q_proj",
                                                "model.layers.0.self_attn.k_proj",
                                                "model.layers.0.self_attn.v_proj"])
    assert prec[GU[0]] == prec[GU[1]] == "fp32"  # up_proj overflows fp16: both stay
    assert len({prec[p] for p in prec if "self_attn" in p}) == 1
    # the export takes it as it is: one scheme per group
    pytest.importorskip("compressed_tensors")
    code, _, err = run_cli(["save", MODEL, "--policy", auto, "--out", tmp_path / "ckpt"],
                           capsys, quiet_warnings=True)
    assert code == 0, err
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["dtype"] == "float32" and cfg["autoprec"]["fused_groups"]

    off = _tune(tmp_path, "off", capsys)
    assert any("model.layers.0.mlp.gate_proj" in t.params for t in _trials(off))
    assert load_policy(auto).provenance["fuse_groups"] == "auto"
    prec_off = compile_plan(load_policy(off, model=model), model).assignment(GU)
    assert prec_off[GU[0]] == "fp16" and prec_off[GU[1]] == "fp32"  # they differ
    code, out, err = run_cli(["save", MODEL, "--policy", off, "--out", tmp_path / "ckpt2"],
                             capsys, quiet_warnings=True)
    # both unquantised: it loads, and the report says a fused runtime runs them in one
    # dtype (a quantised member beside an unquantised one is refused: test_save_cli.py)
    assert code == 0, err
    assert "fused group in two dtypes" in out and "gate_proj fp16, up_proj fp32" in out
