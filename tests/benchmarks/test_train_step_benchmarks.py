"""Smoke tests of the training-step benchmark scripts (``benchmarks/train_step_*.py``): their
tables on tiny configs, so a change that breaks them fails here, not in a long run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from autoprec.trace import trace
from tests.helpers import ROOT


def _script(name: str) -> ModuleType:
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _tiny_gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=32,
                     use_cache=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval(), torch.randint(0, 128, (1, 32))


def test_priced_table_has_every_plan_on_both_devices() -> None:
    bench = _script("train_step_priced")
    model, ids = _tiny_gpt2()
    graph = trace(model, ids, tracers=("hooks",), forward=lambda m, b: m(input_ids=b).logits)
    plans = bench.plans(graph)
    fp8 = plans["fp8 everywhere (TE)"][0].layers
    kept = plans["fp8 first/last bf16 (TE)"][0].layers
    assert fp8 and set(kept) < set(fp8)  # the first and last blocks stay bf16
    assert not any(p.startswith(("transformer.h.0.", "transformer.h.2.")) for p in kept)
    lines = bench.table("tiny", graph, 8)
    rows = [ln for ln in lines if ln.startswith("| fp32 |")]
    assert len(rows) == len(bench.DEVICES) and all("| 1.00x |" in r for r in rows)
    assert sum(ln.startswith("| fp8, dequantised fp32 backward") for ln in lines) == len(
        bench.DEVICES)


def test_cpu_script_offers_the_one_liners_and_a_plan(tmp_path: Path) -> None:
    bench = _script("train_step_cpu")
    model, _ = _tiny_gpt2()
    plans = bench.plans(model, None)
    assert [p.default for p in plans.values()] == ["fp32", "bf16", "fp16", "bf16"]
    mixed = list(plans.values())[-1]
    assert set(mixed.layers.values()) == {"fp32"} and mixed.form == "train"


def test_cpu_script_measures_and_prices_each_plan_on_a_tiny_config(tmp_path: Path,
                                                                    monkeypatch) -> None:  # noqa: ANN001
    """The CPU side of the script, end to end on a tiny GPT-2: each plan's measured step,
    its estimate (the loss priced in it) and peak memory, one row each."""
    import torch.nn.functional as F

    bench = _script("train_step_cpu")
    model, _ = _tiny_gpt2()
    ids = torch.randint(0, 128, (2, 16))

    def tiny() -> tuple:
        return ("tiny", model, lambda m, b: m(input_ids=b).logits,
                lambda o, b: F.cross_entropy(o[:, :-1].float().flatten(0, 1),
                                             b[:, 1:].flatten()), ids, None)

    monkeypatch.setitem(bench.MODELS, "tiny", tiny)
    monkeypatch.setattr(bench, "CACHE", tmp_path)
    rows = bench.run("tiny", None, False)
    table = [r for r in rows if r.startswith("| ") and not r.startswith("| plan | ")]
    assert [r.split(" | ")[0] for r in table] == [
        "| fp32", "| bf16 autocast", "| fp16 autocast + GradScaler",
        "| plan (bf16, first/last GEMM fp32)"]
    assert "loss" in rows[-1] and "optimizer" in rows[-1]  # fp32's estimated step, by part
    for r in table:
        est_ratio = float(r.split(" | ")[3])
        assert 0 < est_ratio < 100  # an estimate and a measurement, both finite


def test_a_reduced_tune_maps_by_block_role_and_is_priced_as_a_row() -> None:
    tuned = _script("train_step_tuned")
    rules = {"transformer.h.0.mlp": "fp8", "transformer.h.1.attn.c_attn": "fp8",
             "transformer.h.2.mlp.c_proj": "bf16", "lm_head": "bf16"}
    full = tuned.map_blocks(rules, 3, 5)
    assert full == {"transformer.h.0.mlp": "fp8", "transformer.h.1.attn.c_attn": "fp8",
                    "transformer.h.2.attn.c_attn": "fp8", "transformer.h.3.attn.c_attn": "fp8",
                    "transformer.h.4.mlp.c_proj": "bf16", "lm_head": "bf16"}
    assert tuned.block_of("model.layers.7.mlp.up_proj") == 7 and tuned.block_of("lm_head") is None
    ids = tuned.text_ids(64)
    assert ids.max() < 256 and bytes(ids.tolist()).decode("utf-8", "ignore").strip()
    bench = _script("train_step_priced")
    model, ids = _tiny_gpt2()
    graph = trace(model, ids, tracers=("hooks",), forward=lambda m, b: m(input_ids=b).logits)
    plan = tuned.Policy(default="bf16", form="train",
                        layers=tuned.map_blocks({"transformer.h.1.mlp": "fp8"}, 3, 3))
    lines = bench.table("tiny", graph, 8, {d: plan for d in bench.DEVICES})
    assert sum(ln.startswith(f"| {bench.TUNED} |") for ln in lines) == len(bench.DEVICES)
