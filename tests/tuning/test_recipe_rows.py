"""A real tiny training tune (``form="train"``) sets the fixed recipes beside its plan: each
recipe a row, priced as a step on the same cost model, short-run checked where it can train,
and the tuned plan written only where it beats the best recipe."""

from __future__ import annotations

import pytest

from autoprec.evaluation.recipes import RECIPES
from autoprec.policy import load_policy
from autoprec.tuning.tune import tune

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real tune: ~40 s of CPU

LLAMA = '''
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

CFG = LlamaConfig(hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=256, vocab_size=256,
                  max_position_embeddings=64, use_cache=False)

def build_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).eval()

def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 32), generator=g) for _ in range(n)]

def calibration_data():
    return _data(1, 2)

def eval_data():
    return _data(2, 1)

def forward(model, batch):
    return model(input_ids=batch).logits

def loss(outputs, batch):
    return F.cross_entropy(outputs[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
'''


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("recipes")
    (d / "model.py").write_text(LLAMA)
    return tune(d / "model.py", max_error=0.5, target="b200", form="train", batch_size=4096,
                trials=2, out=d / "p.yaml", progress=False)


def test_every_recipe_is_a_row_priced_as_a_step(tuned) -> None:
    rows = {r.name: r for r in tuned.plan.speed.rows if r.role == "recipe"}
    assert set(rows) == {r.name for r in RECIPES}
    for name in ("fp8, first/last block bf16 (Megatron)", "nvfp4 + bf16 tail (torchtitan)",
                 "mxfp8 everywhere (torchtitan)", "mxfp8, first/last block bf16 (Megatron)"):
        r = rows[name]
        assert r.policy is not None and r.policy.form == "train", name
        assert r.error is not None and r.est_speedup is not None and r.est_speedup > 0
        assert r.train_bytes is not None  # priced as a training step
    # 128 wide (every dim a multiple of NVFP4's 128): torchao's shape rule converts nothing
    assert "converts no layer" in rows["fp8 torchao auto-filter (tensorwise)"].why_not
    table = tuned.plan.speed.table()
    assert "nvfp4 + bf16 tail (torchtitan)" in table and "bf16 (one global autocast)" in table


def test_written_only_when_it_beats_the_best_recipe(tuned) -> None:
    ok = [r for r in tuned.plan.speed.rows if r.role == "recipe" and r.feasible]
    assert ok  # within the 0.5 budget, and no short run was asked for
    best = max(ok, key=lambda r: r.est_speedup)
    pol = load_policy(tuned.path)
    vs = pol.provenance["versus_recipe"]
    assert vs["recipe"] == best.name
    win = tuned.plan.speed.winner
    if win.role == "tuned":
        assert win.est_speedup > best.est_speedup
        assert int(vs["layers_differing"]) > 0
        assert any(n.startswith("differs from the best fixed recipe") for n in tuned.plan.notes)
    else:
        assert win is best and pol.layers == best.policy.layers
        assert vs["layers_differing"] == "0"
        assert any(n.startswith("wrote the fixed recipe") for n in tuned.plan.notes)
