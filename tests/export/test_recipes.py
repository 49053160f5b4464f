"""The training plan as Transformer Engine and torchao spell it. torchao runs here: its
``convert_to_float8_training`` with the exported filter swaps exactly the plan's fp8
layers. Transformer Engine does not install on this CPU machine: the generated recipe is
compiled and its tables read back with ``ast``, and checked against the plan."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from autoprec.errors import InputError
from autoprec.export.recipes import (
    TE_FACTORIES,
    te_recipe_source,
    torchao_filter_source,
    torchao_module_filter,
)
from autoprec.policy import Policy
from tests.helpers import MODELS, run_cli

pytest.importorskip("transformers")

L = "model.layers"
FP8 = [f"{L}.0.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")] + [
    f"{L}.1.mlp.{n}" for n in ("gate_proj", "up_proj")]


def _model() -> torch.nn.Module:
    from autoprec.workload.loading import load_model_file

    return load_model_file(MODELS / "tiny_llama.py").model()


def _train_policy(extra: dict[str, str] | None = None) -> Policy:
    layers = {p: "fp8" for p in FP8}
    layers[f"{L}.1.mlp.down_proj"] = "fp32"
    layers.update(extra or {})
    return Policy(default="bf16", form="train", layers=layers)


def _assigns(tree: ast.Module, name: str) -> object:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    raise AssertionError(f"{name} not assigned")


def test_te_recipe_names_every_layer_with_its_format() -> None:
    model = _model()
    pol = _train_policy({f"{L}.0.mlp.gate_proj": "mxfp8", f"{L}.0.mlp.up_proj": "mxfp8",
                         "lm_head": "nvfp4"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = te_recipe_source(pol, model)
    compile(src, "te_recipe.py", "exec")  # valid Python
    tree = ast.parse(src)
    formats = ast.literal_eval(_assigns(tree, "FORMATS"))
    regions = ast.literal_eval(_assigns(tree, "REGIONS"))
    want = {p: "fp8" for p in FP8} | {f"{L}.0.mlp.gate_proj": "mxfp8",
                                      f"{L}.0.mlp.up_proj": "mxfp8", "lm_head": "nvfp4"}
    assert formats == want
    assert regions[f"{L}.1.mlp.down_proj"] == "fp32"
    assert regions[f"{L}.0.self_attn.o_proj"] == "bf16"
    leaves = {p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(formats) | set(regions) == leaves and not set(formats) & set(regions)
    # TE's own names (transformer_engine/pytorch/custom_recipes/quantizer_factories.py)
    imported = {a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                for a in node.names}
    assert {"CustomRecipe", "current_scaling_factory", "mxfp8_factory", "nvfp4_factory",
            "high_precision_factory"} <= imported
    factories = _assigns(tree, "FACTORIES")
    assert {ast.literal_eval(k): v.id for k, v in zip(factories.keys, factories.values)} \
        == {f: TE_FACTORIES[f] for f in ("fp8", "mxfp8", "nvfp4")}
    assert "RECIPE = CustomRecipe(qfactory=autoprec_qfactory)" in src


def test_te_factory_picks_by_the_te_module_name() -> None:
    """The generated lookup, run with TE's names stubbed as plain functions (the lookup is
    autoprec's code; TE's factories are not exercised here)."""
    src = te_recipe_source(_train_policy(), _model())
    body = src.split('"""', 2)[2]
    body = "\n".join(x for x in body.splitlines() if not x.startswith(
        ("from transformer_engine", "    current_scaling", "    high_precision", ")",
         "RECIPE")))
    names = {"current_scaling_factory": lambda r: "fp8", "high_precision_factory":
             lambda r: "identity"}
    ns: dict[str, object] = dict(names)
    exec(compile(body, "te_recipe.py", "exec"), ns)  # noqa: S102 (autoprec's own output)

    class Role:
        def __init__(self, name: str) -> None:
            self.name = name

    qf = ns["autoprec_qfactory"]
    assert qf(Role(f"{L}.0.self_attn.q_proj")) == "fp8"  # type: ignore[operator]
    assert qf(Role(f"{L}.0.self_attn.q_proj.fc1")) == "fp8"  # type: ignore[operator]
    assert qf(Role(f"{L}.1.mlp.down_proj")) == "identity"  # type: ignore[operator]
    assert qf(None) == "identity"  # type: ignore[operator]


def test_torchao_swaps_exactly_the_fp8_layers(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    pol = _train_policy()
    path = tmp_path / "fp8_filter.py"
    path.write_text(torchao_filter_source(pol, model))
    ns: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)  # noqa: S102
    convert_to_float8_training(model, module_filter_fn=ns["module_filter_fn"],  # type: ignore[arg-type]
                               config=Float8LinearConfig(emulate=True))
    swapped = sorted(p for p, m in model.named_modules() if isinstance(m, Float8Linear))
    assert swapped == sorted(FP8)
    # and it trains: forward + backward through the swapped layers
    ids = torch.randint(0, 256, (2, 16))
    model.train()
    model(input_ids=ids).logits.float().square().mean().backward()
    assert model.get_submodule(FP8[0]).weight.grad is not None

    fn = torchao_module_filter(pol, _model())  # the in-process filter says the same
    assert sorted(p for p, m in _model().named_modules() if fn(m, p)) == sorted(FP8)


def test_torchao_refuses_a_block_format() -> None:
    pol = _train_policy({"lm_head": "mxfp8"})
    with pytest.raises(InputError, match=r"lm_head: mxfp8.*--to te"):
        torchao_filter_source(pol, _model())


def test_export_recipe_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pol = tmp_path / "p.yaml"
    _train_policy().save(pol)
    out = tmp_path / "recipe.py"
    code, stdout, _ = run_cli(["export-recipe", MODELS / "tiny_llama.py", "--policy", pol,
                               "--to", "te", "--out", out], capsys, quiet_warnings=True)
    assert code == 0 and out.is_file() and "CustomRecipe" in out.read_text()
    code, _, err = run_cli(["export-recipe", MODELS / "tiny_llama.py", "--policy", pol,
                            "--to", "megatron", "--out", out], capsys, quiet_warnings=True)
    assert code == 2 and err.strip().count("\n") == 0 and "megatron" in err
