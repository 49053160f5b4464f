"""The fixed training recipes people copy, as plain policies a tuned plan is set beside.

Each recipe is a rule chosen by hand, read from its library's source or docs:

- ``fp8`` everywhere: every fp8-eligible Linear in fp8 (per-tensor current scaling), the
  rest in one bf16 autocast — torchao's ``convert_to_float8_training`` with no filter
  (``torchao/float8/float8_linear_utils.py``: every ``nn.Linear`` with both dims multiples
  of 16, the LM head included);
- ``mxfp8`` everywhere: every eligible Linear but the LM head — torchtitan's MX converter
  skips ``output`` by default (``filter_fqns = ["output"]``,
  ``torchtitan/components/quantization/mx.py``);
- ``nvfp4`` everywhere: every eligible Linear but the LM head — torchtitan's NVFP4
  converter: "The LM head must be excluded" (its vocabulary is not a multiple of 128;
  ``torchtitan/components/quantization/nvfp4.py``). torchao's NVFP4 training kernels tile
  every GEMM dimension by 128 (``_NVFP4_GEMM_ALIGNMENT = 128``; ``NVFP4Linear.Config``
  refuses other widths), so a Linear whose in or out features are not multiples of 128
  stays bf16 in both NVFP4 recipes (NVFP4's own 16-element block would allow it);
- ``nvfp4 + bf16 tail``: NVFP4 in the leading blocks, the last ``ceil(0.15 L)`` blocks and
  the LM head in bf16 — torchtitan's ``llama3_8b_nvfp4_mixed`` ("layers 0-26 use NVFP4 and
  layers 27-31 remain bf16" for L = 32; ``nvfp4.md``), after NVIDIA's NVFP4 pre-training
  (arXiv 2509.25149);
- Megatron ``first_last_layers_bf16``: fp8 in every block but the first and the last
  (``num_layers_at_start_in_bf16 = num_layers_at_end_in_bf16 = 1``), the LM head in bf16
  (Megatron's output layer is not a Transformer Engine layer: it runs outside the fp8
  region); on Blackwell the same rule with ``--fp8-recipe mxfp8`` (MXFP8 between the two
  bf16 blocks);
- torchao's auto filter (``_auto_filter_for_recipe``, ``torchao/float8/float8_linear_utils.py``,
  H100-benchmarked shape thresholds; ``N, K = weight.shape``, i.e. N = out_features,
  K = in_features): *tensorwise* skips a Linear when ``K <= 4096 and N <= 1024``; *rowwise*
  skips it when ``N <= 2048``, ``K <= 1024`` or ``N <= 4096 and K <= 2048``. Priced as
  autoprec's fp8 (per-tensor current scaling): the filter is what differs.

Every recipe runs ``default: bf16`` (one bf16 autocast over fp32 masters, as the libraries'
trainers do) with one rule per Linear leaf it converts; a leaf the format cannot take
(``LayerNode.allowed``: alignment) stays bf16, as the libraries skip it. ``recipe_plans``
builds them from a model and its ``LayerGraph``; ``differences`` says, per layer, where a
plan differs from a recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.policy import Policy

#: Share of the blocks torchtitan's NVFP4 recipe keeps in bf16 at the end (rounded up).
NVFP4_TAIL = 0.15
#: Blocks Megatron keeps in bf16 at each end (``first_last_layers_bf16``'s defaults).
MEGATRON_FIRST, MEGATRON_LAST = 1, 1
#: Width torchao's NVFP4 training kernels need of every GEMM dimension (torchtitan's
#: ``_NVFP4_GEMM_ALIGNMENT``: their tiling, not NVFP4's 16-element block).
NVFP4_ALIGN = 128


@dataclass(frozen=True)
class Recipe:
    """One fixed recipe: its key, the name people know it by, its GEMM format, its source,
    and its rule: whether the LM head is converted, the blocks kept bf16 (a share at the
    end, rounded up; a count at each end), torchao's shape filter ("tensorwise" /
    "rowwise"), the width every converted Linear's dims must divide by."""

    key: str
    name: str
    fmt: str
    source: str
    converts_head: bool = False
    bf16_tail: float = 0.0
    bf16_ends: tuple[int, int] = (0, 0)
    torchao_filter: str | None = None
    #: in and out features must be multiples of this (beyond the format's own alignment)
    align: int = 1


RECIPES: tuple[Recipe, ...] = (
    Recipe("fp8", "fp8 everywhere (torchao)", "fp8",
           "torchao convert_to_float8_training, no filter", converts_head=True),
    Recipe("torchao-tensorwise", "fp8 torchao auto-filter (tensorwise)", "fp8",
           "torchao _auto_filter_for_recipe('tensorwise')", converts_head=True,
           torchao_filter="tensorwise"),
    Recipe("torchao-rowwise", "fp8 torchao auto-filter (rowwise)", "fp8",
           "torchao _auto_filter_for_recipe('rowwise')", converts_head=True,
           torchao_filter="rowwise"),
    Recipe("megatron-first-last", "fp8, first/last block bf16 (Megatron)", "fp8",
           "Megatron first_last_layers_bf16, 1 and 1",
           bf16_ends=(MEGATRON_FIRST, MEGATRON_LAST)),
    Recipe("megatron-first-last-mxfp8", "mxfp8, first/last block bf16 (Megatron)", "mxfp8",
           "Megatron first_last_layers_bf16, 1 and 1, --fp8-recipe mxfp8",
           bf16_ends=(MEGATRON_FIRST, MEGATRON_LAST)),
    Recipe("mxfp8", "mxfp8 everywhere (torchtitan)", "mxfp8",
           "torchtitan MX converter, filter_fqns=['output']"),
    Recipe("nvfp4", "nvfp4 everywhere (torchtitan)", "nvfp4",
           "torchtitan NVFP4 converter, LM head excluded", align=NVFP4_ALIGN),
    Recipe("nvfp4-tail", "nvfp4 + bf16 tail (torchtitan)", "nvfp4",
           "torchtitan llama3_8b_nvfp4_mixed: last ceil(0.15 L) blocks + LM head bf16",
           bf16_tail=NVFP4_TAIL, align=NVFP4_ALIGN),
)
RECIPE_BY_KEY = {r.key: r for r in RECIPES}


@dataclass(frozen=True)
class RecipePlan:
    """A recipe applied to one model: its policy and the blocks it kept in bf16."""

    recipe: Recipe
    policy: Policy
    bf16_blocks: tuple[str, ...] = ()


# -- the model's structure ---------------------------------------------------------------------
def decoder_blocks(model: nn.Module) -> list[str]:
    """The paths of the model's repeated blocks, in order: the children of its largest
    ``nn.ModuleList`` whose members hold Linear layers (``model.layers.0`` … for a HF
    Llama, ``transformer.h.0`` … for GPT-2); [] when it has none."""
    best: list[str] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) <= len(best):
            continue
        kids = [f"{path}.{i}" if path else str(i) for i in range(len(mod))]
        if all(any(isinstance(m, nn.Linear) for m in child.modules()) for child in mod):
            best = kids
    return best


def lm_head(model: nn.Module) -> str | None:
    """The output projection: HF's ``get_output_embeddings()``, else the last Linear
    outside every block (torchtitan's ``output``)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    blocks = tuple(f"{b}." for b in decoder_blocks(model))
    found = None
    for path, mod in model.named_modules():
        if head is not None and mod is head:
            return path
        if isinstance(mod, nn.Linear) and not path.startswith(blocks):
            found = path
    return None if head is not None else found


def block_of(path: str, blocks: Sequence[str]) -> int | None:
    """The index of the block holding ``path`` (None: outside every block)."""
    for i, b in enumerate(blocks):
        if path == b or path.startswith(b + "."):
            return i
    return None


# -- torchao's shape rule ----------------------------------------------------------------------
def torchao_keeps(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether torchao's ``_auto_filter_for_recipe(recipe)`` converts a Linear of these
    dims (its source, with ``N, K = weight.shape``): the 16-alignment, then the thresholds."""
    n, k = out_features, in_features
    if k % 16 or n % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    raise ValueError(f"torchao recipe must be 'tensorwise' or 'rowwise', got {recipe!r}")


def aligned(mod: nn.Module, width: int) -> bool:
    """Whether a Linear-like leaf's two weight dims (in and out features: ``nn.Linear``'s
    (out, in), HF ``Conv1D``'s (in, out)) are both multiples of ``width``; a leaf without a
    2-D weight is not."""
    w = getattr(mod, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2
            and all(d % width == 0 for d in w.shape))


# -- the plans ---------------------------------------------------------------------------------
def _eligible(graph: Any, fmt: str) -> list[str]:
    """The Linear-like leaves that may run ``fmt`` (``LayerNode.allowed``), in model order."""
    return [n.path for n in graph.nodes.values() if n.is_leaf and fmt in n.allowed]


def recipe_plans(model: nn.Module, graph: Any, keys: Sequence[str] | None = None,
                 fingerprint: str | None = None, target: str | None = None
                 ) -> list[RecipePlan]:
    """Each recipe (``RECIPES``, or those of ``keys``) as a train-form policy for
    ``model`` (weights may be on the meta device; ``graph``: its ``LayerGraph``)."""
    blocks = decoder_blocks(model)
    head = lm_head(model)
    modules = dict(model.named_modules())
    n = len(blocks)
    out = []
    for r in RECIPES if keys is None else [RECIPE_BY_KEY[k] for k in keys]:
        leaves = _eligible(graph, r.fmt)
        keep_bf16 = set(range(n - math.ceil(r.bf16_tail * n), n)) if n else set()
        first, last = r.bf16_ends
        keep_bf16 |= set(range(min(first, n))) | set(range(max(n - last, 0), n))
        chosen = []
        for p in leaves:
            if (p == head and not r.converts_head) or block_of(p, blocks) in keep_bf16:
                continue
            mod = modules[p]
            if r.align > 1 and not aligned(mod, r.align):
                continue
            if r.torchao_filter is not None and (not isinstance(mod, nn.Linear) or not (
                    torchao_keeps(r.torchao_filter, mod.out_features, mod.in_features))):
                continue
            chosen.append(p)
        model_meta = {"fingerprint": fingerprint} if fingerprint else {}
        pol = Policy(default="bf16", layers=dict.fromkeys(chosen, r.fmt), form="train",
                     model=model_meta, target={"device": target} if target else {},
                     provenance={"recipe": r.key, "recipe_source": r.source})
        out.append(RecipePlan(r, pol, tuple(blocks[i] for i in sorted(keep_bf16))))
    return out


# -- the rows ----------------------------------------------------------------------------------
def recipe_rows(cost: Any, plans: Sequence[RecipePlan],
                errors: Callable[[Policy], tuple[float, float | None]] | None,
                budget: float | None, *, precisions: Sequence[str] | None = None,
                train_aware: bool = False, audit: Callable[[Policy], list[str]] | None = None,
                train_check: Callable[[Policy, str], str] | None = None) -> list[Any]:
    """The recipes as rows (``rows.Row``, role "recipe") beside a training tune's plan and
    its one-liners, judged as the one-liners are (``baselines.baseline_rows``): runs on the
    target, error within ``budget`` (``errors(policy)``: (calibration, eval or None); None:
    not scored, priced only), asked for in ``precisions``, the audit, and, with
    ``train_aware``, the short run (``train_check``)."""
    from autoprec.evaluation.rows import Row

    rows = []
    for rp in plans:
        r, pol = rp.recipe, rp.policy
        ok, why = cost.profile.supports(r.fmt)
        if not ok:
            rows.append(Row(r.name, "recipe", None,
                            why_not=f"not on {cost.profile.name}: {why}"))
            continue
        if not pol.layers:
            rows.append(Row(r.name, "recipe", None,
                            why_not=f"converts no layer of this model ({r.source})"))
            continue
        err: float | None = None
        why = ""
        if errors is None:
            why = "not scored (priced only)"
        else:
            try:
                calib, evl = errors(pol)
            except RuntimeError as e:
                rows.append(Row(r.name, "recipe", None,
                                why_not=f"does not run on this model: {str(e).splitlines()[0]}"))
                continue
            err = calib if evl is None else evl
            if budget is not None and not (calib <= budget and (evl is None or evl <= budget)):
                why = f"over budget ({err:.3g} > {budget:g})"
        if not why and audit is not None:
            found = audit(pol)
            why = f"audit: {found[0]}" if found else ""
        if not why and precisions is not None and r.fmt not in precisions:
            why = "not in --precisions"
        if not why and cost.cannot_run(pol):
            why = cost.cannot_run(pol)[0]
        if not why and train_aware:
            if train_check is None:
                why = "not training-checked (--train-aware)"
            else:
                why = train_check(pol, r.name)
        row = Row(r.name, "recipe", pol, err, not why, cost.speedup(pol), why_not=why,
                  weight_bytes=cost.weight_bytes(pol))
        row.source = (err if err is not None else math.inf, None)
        rows.append(row)
    return rows


# -- where a plan differs from a recipe --------------------------------------------------------
@dataclass(frozen=True)
class LayerDiff:
    """One layer where a plan and a recipe differ: the recipe's precision, the plan's, why."""

    path: str
    recipe: str
    plan: str
    why: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "recipe": self.recipe, "plan": self.plan, "why": self.why}


def _precision_at(policy: Policy, path: str) -> str:
    """The precision ``policy`` gives a leaf: the most specific rule covering it, else the
    default."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        got = policy.layers.get(".".join(parts[:i]))
        if got is not None:
            return got
    return policy.default


def differences(plan: Policy, recipe: Policy, leaves: Sequence[str],
                why: Callable[[str, str, str], str] | None = None) -> list[LayerDiff]:
    """Per GEMM leaf of ``leaves`` (model order) where ``plan`` runs another precision than
    ``recipe``; ``why(path, recipe_precision, plan_precision)`` says why (default: the
    plan's own ``reasons`` for that layer, else nothing)."""
    out = []
    for p in leaves:
        a, b = _precision_at(recipe, p), _precision_at(plan, p)
        if a == b:
            continue
        text = why(p, a, b) if why is not None else plan.reasons.get(p, "")
        out.append(LayerDiff(p, a, b, text))
    return out


def diff_provenance(name: str, diffs: Sequence[LayerDiff], limit: int = 64) -> dict[str, str]:
    """The diff as the policy file records it (``provenance.versus_recipe``: a mapping of
    scalars): the recipe's name, then ``path: "recipe -> plan: why"`` per layer."""
    out = {"recipe": name, "layers_differing": str(len(diffs))}
    for d in diffs[:limit]:
        out[d.path] = f"{d.recipe} -> {d.plan}" + (f": {d.why}" if d.why else "")
    return out


__all__ = ["LayerDiff", "MEGATRON_FIRST", "MEGATRON_LAST", "NVFP4_ALIGN", "NVFP4_TAIL",
           "RECIPES", "RECIPE_BY_KEY", "Recipe", "RecipePlan", "aligned", "block_of",
           "decoder_blocks",
           "diff_provenance", "differences", "lm_head", "recipe_plans", "recipe_rows",
           "torchao_keeps"]
