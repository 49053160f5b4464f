"""A training plan as the training stacks spell it: Transformer Engine and torchao.

Both exports read the plan's precision of every GEMM leaf (``plan.assignment``: container
rules resolved as ``apply`` resolves them) and write Python a training script imports:

- **Transformer Engine** (``te_recipe_source``): a ``CustomRecipe(qfactory=…)`` whose
  factory picks, per TE module, TE's own quantiser factory for the layer's format —
  ``current_scaling_factory`` for fp8 (per-tensor current scaling, E4M3 forward, E5M2
  gradients: autoprec's fp8), ``mxfp8_factory``, ``nvfp4_factory`` — and
  ``high_precision_factory`` (TE's ``IdentityQuantizer``: the GEMM runs in the module's
  dtype) for every other layer. TE names a module's quantiser slots by the ``name`` its
  creator gave it (``te.Linear(..., name="model.layers.0.mlp.up_proj")``, composite modules
  add ``.fc1``/``.proj`` suffixes; ``QuantizerRole.name``), so the factory looks the name up
  in the plan's table, falling back to the longest enclosing path. API names from
  ``transformer_engine/pytorch/custom_recipes/quantizer_factories.py`` and
  ``docs/…/custom_recipes`` (TE main, 2026): experimental, and TE does not install here,
  so the text is checked (``compile``, the table read back with ``ast``) rather than run.
- **torchao** (``torchao_filter_source`` / ``torchao_module_filter``): the
  ``module_filter_fn(module, fqn)`` of ``torchao.float8.convert_to_float8_training``,
  true exactly for the plan's fp8 layers. torchao's float8 training is per-tensor
  (tensorwise) scaling by default, as autoprec's fp8 is. Its MX/NVFP4 training recipes are
  prototypes for MoE grouped GEMMs, so a plan with mxfp8 / nvfp4 layers is refused here
  (export it to TE).

A layer in bf16 / fp16 / fp32 is a region, not a quantiser: neither stack sets a dtype
per module through these hooks (TE: the module's ``params_dtype`` and ``torch.autocast``;
torchao: the training loop's autocast). The generated file lists them as comments and
in ``REGIONS``, so a reader sees every layer of the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from autoprec.errors import InputError
from autoprec.formats.gemm import is_gemm_module
from autoprec.formats.precisions import is_gemm_format
from autoprec.policy import Policy, load_policy

#: autoprec format -> Transformer Engine's factory of the same recipe.
TE_FACTORIES = {"fp8": "current_scaling_factory", "mxfp8": "mxfp8_factory",
                "nvfp4": "nvfp4_factory"}
TE_HIGH_PRECISION = "high_precision_factory"
#: autoprec format -> torchao's training module for it (float8 only: its MX/NVFP4 training
#: is a prototype for MoE grouped GEMMs).
TORCHAO_MODULES = {"fp8": "torchao.float8.Float8Linear"}
_TORCHAO_FP8 = next(iter(TORCHAO_MODULES))


def layer_precisions(policy: Policy | str | Path, model: torch.nn.Module,
                     force: bool = False) -> tuple[Policy, dict[str, str]]:
    """``(policy, {gemm leaf path: precision})`` in the model's module order."""
    from autoprec.plan import compile_plan

    pol = policy if isinstance(policy, Policy) else load_policy(policy, model=model,
                                                                force=force)
    if isinstance(policy, Policy):
        pol.validate(model, force=force)
    leaves = [p for p, m in model.named_modules()
              if p and is_gemm_module(m) and not any(True for _ in m.children())]
    return pol, compile_plan(pol, model).assignment(leaves)


def _table(name: str, rows: dict[str, str]) -> list[str]:
    out = [f"{name} = {{"]
    out += [f"    {path!r}: {prec!r}," for path, prec in rows.items()]
    out.append("}")
    return out


def te_recipe_source(policy: Policy | str | Path, model: torch.nn.Module,
                     force: bool = False) -> str:
    """Python source of a Transformer Engine ``CustomRecipe`` for the plan (module doc)."""
    pol, prec = layer_precisions(policy, model, force)
    formats = {p: f for p, f in prec.items() if is_gemm_format(f)}
    regions = {p: f for p, f in prec.items() if not is_gemm_format(f)}
    used = sorted({TE_FACTORIES[f] for f in formats.values()} | {TE_HIGH_PRECISION})
    lines = [
        f'"""Transformer Engine recipe for {pol.model.get("name") or "the model"}: '
        f'written by autoprec from {pol.source}.',
        "",
        "Each TE module must be created with name=<its module path> (te.Linear(..., "
        "name=path));",
        "the factory gives it the quantiser of its layer's format. Layers in REGIONS run "
        "in their",
        "dtype (the module's params_dtype / torch.autocast), not through a quantiser.",
        "",
        "    with te.autocast(enabled=True, recipe=RECIPE):",
        "        loss = model(batch)",
        '"""',
        "",
        "from transformer_engine.common.recipe import CustomRecipe",
        "from transformer_engine.pytorch.custom_recipes.quantizer_factories import (",
        *[f"    {n}," for n in used],
        ")",
        "",
        f"DEFAULT = {pol.default!r}  # the region of everything no layer below names",
        "# GEMM layer -> its format (fp8: per-tensor current scaling, E4M3 fwd / E5M2 grads)",
        *_table("FORMATS", formats),
        "# GEMM layers computing in a dtype, not a quantised format",
        *_table("REGIONS", regions),
        "FACTORIES = {",
        *[f"    {f!r}: {TE_FACTORIES[f]}," for f in sorted(set(formats.values()))],
        "}",
        "",
        "",
        "def layer_format(name):",
        '    """The format of the TE module named ``name`` (the longest enclosing path, for',
        '    composite modules\' ``.fc1`` / ``.proj`` suffixes), or None."""',
        "    while name:",
        "        if name in FORMATS:",
        "            return FORMATS[name]",
        "        if name in REGIONS:",
        "            return None",
        "        name = name.rpartition('.')[0]",
        "    return None",
        "",
        "",
        "def autoprec_qfactory(role):",
        '    """CustomRecipe quantiser factory: the plan\'s format for the module\'s slots."""',
        "    fmt = layer_format(role.name if role is not None else '')",
        f"    return FACTORIES.get(fmt, {TE_HIGH_PRECISION})(role)",
        "",
        "",
        "RECIPE = CustomRecipe(qfactory=autoprec_qfactory)",
        "",
    ]
    return "\n".join(lines)


def torchao_fp8_layers(policy: Policy | str | Path, model: torch.nn.Module,
                       force: bool = False) -> tuple[Policy, list[str]]:
    """The plan's fp8 layers; InputError when it has a format torchao cannot train."""
    pol, prec = layer_precisions(policy, model, force)
    other = {p: f for p, f in prec.items() if is_gemm_format(f) and f not in TORCHAO_MODULES}
    if other:
        path, fmt = next(iter(other.items()))
        raise InputError(f"{path}: {fmt}: torchao's float8 training takes fp8 layers only "
                         f"(its MX/NVFP4 training is a prototype for MoE GEMMs); export "
                         f"this plan with --to te")
    mods = dict(model.named_modules())
    fp8 = [p for p, f in prec.items() if f == _TORCHAO_FP8]
    for p in fp8:
        if type(mods[p]) is not torch.nn.Linear:
            raise InputError(f"{p}: fp8 on a {type(mods[p]).__name__}: torchao's "
                             "convert_to_float8_training swaps torch.nn.Linear only")
    return pol, fp8


def torchao_module_filter(policy: Policy | str | Path, model: torch.nn.Module,
                          force: bool = False) -> Callable[[torch.nn.Module, str], bool]:
    """``module_filter_fn(module, fqn)`` for ``convert_to_float8_training``: True exactly
    for the plan's fp8 layers."""
    _, fp8 = torchao_fp8_layers(policy, model, force)
    chosen = frozenset(fp8)

    def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
        return fqn in chosen

    return module_filter_fn


def torchao_filter_source(policy: Policy | str | Path, model: torch.nn.Module,
                          force: bool = False) -> str:
    """Python source defining ``FP8_LAYERS``, ``module_filter_fn`` and ``convert(model)``
    (``convert_to_float8_training`` with that filter)."""
    pol, fp8 = torchao_fp8_layers(policy, model, force)
    _, prec = layer_precisions(pol, model, force)
    regions = {p: f for p, f in prec.items() if p not in set(fp8)}
    lines = [
        f'"""torchao float8 training for {pol.model.get("name") or "the model"}: written by '
        f'autoprec from {pol.source}.',
        "",
        "    from torchao.float8 import Float8LinearConfig",
        "    model = convert(model, Float8LinearConfig())  # tensorwise scaling",
        "",
        f"Every other layer runs in its region (REGIONS; default {pol.default!r}) under the",
        "training loop's torch.autocast.",
        '"""',
        "",
        "FP8_LAYERS = frozenset({",
        *[f"    {p!r}," for p in fp8],
        "})",
        *_table("REGIONS", regions),
        "",
        "",
        "def module_filter_fn(module, fqn):",
        '    """True for the layers the plan runs in fp8."""',
        "    return fqn in FP8_LAYERS",
        "",
        "",
        "def convert(model, config=None):",
        '    """The model with its fp8 layers swapped for torchao\'s Float8Linear."""',
        "    from torchao.float8 import convert_to_float8_training",
        "",
        "    return convert_to_float8_training(model, module_filter_fn=module_filter_fn,",
        "                                      config=config)",
        "",
    ]
    return "\n".join(lines)


__all__ = ["TE_FACTORIES", "TORCHAO_MODULES", "layer_precisions", "te_recipe_source", "torchao_filter_source",
           "torchao_fp8_layers", "torchao_module_filter"]
