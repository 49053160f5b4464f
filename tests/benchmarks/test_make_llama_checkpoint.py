"""benchmarks/make_llama_checkpoint.py writes, shard by shard, the folder ``save_pretrained``
would write: transformers loads it, autoprec streams it, and the weights do not depend on
how the tensors were cut into shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from benchmarks import make_llama_checkpoint as mk
from tests.helpers import ROOT, cli_env


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_tiny_checkpoint_loads_and_streams(tmp_path: Path) -> None:
    from autoprec.stream import open_streamed

    folder = mk.write("tiny", tmp_path / "tiny", shard_gb=60e3 / 1e9)  # 60 KB shards
    index = json.loads((folder / mk.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {p.name for p in folder.glob("*.safetensors")} == set(shards)
    assert "model.layers.1.mlp.down_proj.weight" in index["weight_map"]
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # its own dtype, bf16
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (32, 64)  # 2 KV heads x 16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    w = model.model.layers[1].mlp.up_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.005  # N(0, 0.02)
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert index["metadata"]["total_size"] == sum(p.numel() * 2 for p in model.parameters())
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    model.config.use_cache = False
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, open_streamed(folder)(input_ids=x).logits)


def test_weights_do_not_depend_on_the_shards(tmp_path: Path) -> None:
    one = _tensors(mk.write("tiny", tmp_path / "one"))
    many = _tensors(mk.write("tiny", tmp_path / "many", shard_gb=30e3 / 1e9))
    other = _tensors(mk.write("tiny", tmp_path / "other", seed=1))
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert not torch.equal(one["lm_head.weight"], other["lm_head.weight"])
    assert not torch.equal(one["model.layers.0.mlp.up_proj.weight"],
                           one["model.layers.1.mlp.up_proj.weight"])


def test_presets_have_the_public_sizes() -> None:
    params = {p: mk.parameters(p) for p in ("1.1b", "3b", "8b")}
    assert 1.09e9 < params["1.1b"] < 1.11e9  # TinyLlama-1.1B: 1,100,048,384
    assert 3.2e9 < params["3b"] < 3.22e9  # Llama-3.2-3B: 3.21 B (tied embeddings)
    assert 8.02e9 < params["8b"] < 8.04e9  # Llama-3.1-8B: 8,030,261,248
    specs = dict(mk.tensor_specs(mk.config_of("8b")))
    assert specs["model.layers.31.mlp.gate_proj.weight"] == (14336, 4096)
    assert specs["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)  # 8 KV heads
    assert "lm_head.weight" not in dict(mk.tensor_specs(mk.config_of("3b")))  # tied


def test_plan_shards_cuts_in_order() -> None:
    specs = [("a", (10,)), ("b", (10,)), ("c", (30,)), ("d", (5,))]  # 20, 20, 60, 10 bytes
    assert [[n for n, _ in s] for s in mk.plan_shards(specs, 45)] == [["a", "b"], ["c"], ["d"]]


@pytest.mark.slow
def test_cli_writes_a_folder_autoprec_takes(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.make_llama_checkpoint", "--preset",
                          "tiny", "--out", str(tmp_path / "ck")], cwd=ROOT, env=cli_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "model-00001-of-00001.safetensors: 21 tensors" in run.stdout
    from autoprec.stream import is_checkpoint_dir

    assert is_checkpoint_dir(tmp_path / "ck")
