"""Compile a policy and a model into the module level of an execution plan.

A policy is a default plus rules (module path -> precision; the most specific path wins,
a GEMM-format rule reaches only the format-eligible Linear-like leaves it covers). This is
the one place that decides which rule covers a module (``RuleSet``): apply, the audit,
check, train and the search read the plan, never the rules. The plan gives every module:

- its *region*: the numeric context its own code runs in (fp32 / tf32: autocast off;
  bf16 / fp16: ``torch.autocast``). The default is the root's region: the model's own code
  (norms, activations, residual adds) runs there, so ``default: bf16`` runs like one global
  bf16 autocast and rules are exceptions;
- its *precision*: its region, or fp8 for an fp8-eligible leaf under an fp8 rule;
- its *rule*: the rule that decided its precision (None: the default);
- whether it is *wrapped*: a module whose precision differs from the region it is called
  from gets a forward wrapper that enters its region (and the root always does). Children
  at their caller's region need nothing: same-precision neighbours share one region.

What a wrapper does at the boundary ("a tensor is cast only where its consumer needs
another dtype"):

- entering a fp32/tf32 region, 16-bit floating inputs are cast to fp32 (a fp32 island's
  code then never meets a 16-bit tensor: "mat1 and mat2 must have the same dtype");
- leaving into a fp32/tf32 caller, 16-bit outputs are cast to fp32 (the caller's code
  computes in fp32, e.g. SDPA refuses q, k, v of mixed dtypes);
- leaving into an autocast caller, nothing is cast: autocast casts at each consumer that
  needs another dtype (a GEMM casts to its region's dtype, CUDA's layer_norm to fp32), and
  pointwise ops read mixed dtypes directly. So a fp16 layer inside a bf16 region costs one
  cast where its output is consumed, not a cast out and a cast back in;
- a GEMM-format leaf (fp8, mxfp8, nvfp4) takes its input in whatever dtype it arrives
  and gives the surrounding region's 16-bit dtype (fp32 in a fp32 region).

``RuleSet.encode`` computes regions, precisions and wrappers for many rule assignments at
once (numpy, for the search); ``compile_plan`` is the same code for one policy, and
``resolve`` / ``assignment`` / ``resolve_path`` read such a plan. The replay of a
recorded forward under a plan (dtypes of every tensor, every cast) is
``autoprec.plan.schedule``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from autoprec.errors import PolicyError, warn
from autoprec.formats.precisions import GEMM_FORMATS, PRECISIONS
from autoprec.io.paths import normalize_path, unwrap_model
from autoprec.policy.modules import (
    Resolved,
    alias_paths,
    canonical_rules,
    format_eligible,
    gemm_leaf_paths,
)
from autoprec.policy.schema import Policy
from autoprec.trace.graph import LayerGraph

#: Precision codes (index into PRECISIONS): 0 fp32, 1 tf32, 2 bf16, 3 fp16, 4 fp8, 5 mxfp8,
#: 6 nvfp4.
CODE = {p: i for i, p in enumerate(PRECISIONS)}
#: Codes of the GEMM formats (module backends, never a region), in GEMM_FORMATS order.
FORMAT_CODES = np.array([CODE[f] for f in GEMM_FORMATS], dtype=np.intp)
NO_RULE = -1
#: Code + 1 -> is a GEMM format (NO_RULE at 0).
_IS_FORMAT = np.zeros(len(PRECISIONS) + 1, dtype=bool)
_IS_FORMAT[FORMAT_CODES + 1] = True
#: Containers whose own forward is never called (their owner iterates or indexes them).
NEVER_CALLED = (torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass(frozen=True)
class ModuleTree:
    """What compiling needs to know about a model: its modules and how rules reach them."""

    paths: list[str]  # module paths, ``named_modules()`` order (a shared module once)
    caller: np.ndarray  # (M,) index of the nearest ancestor whose forward runs; -1: root
    format_ok: np.ndarray  # (M, len(GEMM_FORMATS)) bool: a leaf eligible for each format
    never_called: np.ndarray  # (M,) bool: ModuleList / ModuleDict
    aliases: dict[str, str] = field(default_factory=dict)  # other path of a shared module

    @classmethod
    def build(cls, paths: Sequence[str], never_called: Sequence[bool],
              format_ok: Sequence[Sequence[bool]],
              aliases: Mapping[str, str] | None = None) -> ModuleTree:
        index = {p: i for i, p in enumerate(paths)}
        never = np.array(never_called, dtype=bool)
        caller = np.full(len(paths), -1, dtype=np.intp)
        for i, p in enumerate(paths):
            if not p:
                continue
            parent = p.rpartition(".")[0]
            while parent and never[index[parent]]:
                parent = parent.rpartition(".")[0]
            caller[i] = index.get(parent, 0)
        ok = np.array(format_ok, dtype=bool).reshape(len(paths), len(GEMM_FORMATS))
        return cls(list(paths), caller, ok, never, dict(aliases or {}))

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModuleTree:
        root = unwrap_model(model)
        named = list(root.named_modules())
        return cls.build([normalize_path(p) for p, _ in named],
                         [isinstance(m, NEVER_CALLED) for _, m in named],
                         [[format_eligible(m, f) for f in GEMM_FORMATS] for _, m in named],
                         alias_paths(root))

    @classmethod
    def from_graph(cls, graph: LayerGraph) -> ModuleTree:
        """The tree of a traced model (its op trace's module order), without the model."""
        if graph.ops is None:
            raise ValueError("the graph has no op trace (trace() records one)")
        paths = graph.ops.modules
        nodes = [graph.nodes.get(p) for p in paths]
        return cls.build(paths,
                         [n is not None and n.module_type in ("ModuleList", "ModuleDict")
                          for n in nodes],
                         [[n is not None and n.is_leaf and f in n.allowed for f in GEMM_FORMATS]
                          for n in nodes])

    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.paths)}


class RuleSet:
    """Fixed rule paths; an assignment of them is a code row.

    ``encode(codes)`` with ``codes`` (T, K) — slot 0 the default's precision code, then one
    per rule path (NO_RULE: "no rule here") — returns regions, precisions and wrappers
    (T, M) of every module; ``decide(codes)`` the deciding rules too. One function
    resolves every plan (``_cover_pick``): apply, the schedule and the search all call it.
    """

    def __init__(self, tree: ModuleTree, rule_paths: Sequence[str]) -> None:
        # slot 0: the default; then the rules ("" too: a rule on the root, e.g. fp8)
        paths = ["<default>", *dict.fromkeys(tree.aliases.get(p, p) for p in rule_paths)]
        index = tree.index()
        unknown = [p for p in paths[1:] if p not in index]
        if unknown:
            raise KeyError(unknown[0])
        self.tree = tree
        self.rule_paths = paths
        depth = [-1] + [0 if p == "" else p.count(".") + 1 for p in paths[1:]]
        # for every module: the rules covering it (on it or an ancestor), shallowest first
        slot = {rp: k for k, rp in enumerate(paths) if k}
        self._cover: list[list[int]] = []
        for mp in tree.paths:
            cov, p = [0], mp
            while True:
                if p in slot:
                    cov.append(slot[p])
                if not p:
                    break
                p = p.rpartition(".")[0]
            self._cover.append(sorted(cov, key=lambda k: (depth[k], k)))
        # the same as a (M, W) index table, padded with K (a column that never holds a rule)
        width = max([2, *(len(c) for c in self._cover)])
        self._cov = np.full((len(tree.paths), width), len(paths), dtype=np.intp)
        for j, cov in enumerate(self._cover):
            self._cov[j, :len(cov)] = cov

    def encode(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(region, precision, wrapped), each (T, M); see the class docstring."""
        region, prec, _, _ = self._cover_pick(codes)
        return region, prec, self._wrapped(region, prec)

    def decide(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(region, precision, rule), each (T, M): ``rule`` is the slot in ``rule_paths``
        of the rule that decided the precision (0: the default) — the format rule where a
        module runs a GEMM format, else the rule that gave its region."""
        region, prec, deepest, last = self._cover_pick(codes)
        at = np.where(prec != region, deepest, last)  # (T, M) a column of the cover table
        return region, prec, self._cov[np.arange(self._cov.shape[0])[None, :], at]

    def _cover_pick(self, codes: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(region, precision, deepest, last), each (T, M): the decision itself.

        Per module: its region is the deepest rule covering it that is set and is not a
        GEMM format (else the default, slot 0: column ``last`` of the cover table); its
        precision is a GEMM format where the deepest set rule (column ``deepest``) is one
        and the module is eligible, else its region. One gather over the (M, W) cover
        table, (T, M, W) int8 at most.
        """
        codes = np.atleast_2d(np.asarray(codes, dtype=np.intp))
        t = codes.shape[0]
        ext = np.concatenate([codes, np.full((t, 1), NO_RULE, dtype=np.intp)], axis=1)
        ext = ext.astype(np.int8)
        cov = ext[:, self._cov]  # (T, M, W): the covering rules' codes, shallowest first
        set_ = cov != NO_RULE
        w = cov.shape[2]
        # deepest set non-format rule (slot 0, the default, is always set and never fp8)
        usable = set_ & ~_IS_FORMAT[cov.astype(np.intp) + 1]
        last = w - 1 - np.argmax(usable[:, :, ::-1], axis=2)
        region = np.take_along_axis(cov, last[:, :, None], axis=2)[:, :, 0].astype(np.intp)
        # deepest set rule of any kind among the rules proper (slot 1 on)
        rules = set_[:, :, 1:]
        any_rule = rules.any(axis=2)
        deepest = w - 1 - np.argmax(rules[:, :, ::-1], axis=2)
        first = np.where(any_rule,
                         np.take_along_axis(cov, deepest[:, :, None], axis=2)[:, :, 0],
                         NO_RULE)
        prec = region.copy()
        for fi, fc in enumerate(FORMAT_CODES):
            prec = np.where((first == fc) & self.tree.format_ok[None, :, fi], fc, prec)
        return region, prec, deepest, last

    def _wrapped(self, region: np.ndarray, prec: np.ndarray) -> np.ndarray:
        """(T, M) bool: a module whose precision differs from its caller's region (and the
        root) gets a wrapper."""
        caller = self.tree.caller
        parent_region = np.where(caller[None, :] >= 0, region[:, np.maximum(caller, 0)], -1)
        wrapped = (prec != parent_region) & ~self.tree.never_called[None, :]
        wrapped[:, 0] = True  # the root: the default holds even under a caller's autocast
        return wrapped

    def rule_path(self, slot: int) -> str | None:
        """The rule path of a slot (None: slot 0, the default)."""
        return self.rule_paths[slot] if slot else None

    def codes_of(self, default: str, layers: Mapping[str, str]) -> np.ndarray:
        """The code row (K,) of one policy whose rules are all among ``rule_paths``."""
        row = np.full(len(self.rule_paths), NO_RULE, dtype=np.intp)
        row[0] = CODE[default]
        pos = {p: k for k, p in enumerate(self.rule_paths) if k}
        for p, prec in layers.items():
            row[pos[self.tree.aliases.get(p, p)]] = CODE[prec]
        return row


@dataclass(frozen=True)
class Wrapped:
    """One installed wrapper."""

    path: str  # the module's first path
    precision: str  # what the wrapper computes in (a region, or fp8)
    rule: str | None  # the rule that decided it (None: the default)


@dataclass
class ExecutionPlan:
    """The module level of a plan for one policy (``plan.schedule`` adds the tensors).

    The one resolution of the policy on the model: ``resolution()`` (every module path),
    ``assignment(paths)`` (path -> precision) and ``wrappers()`` read it.
    """

    policy: Policy
    tree: ModuleTree
    rules: RuleSet
    codes: np.ndarray  # (K,) the policy as a code row of ``rules``
    region: np.ndarray  # (M,) region code of every module
    precision: np.ndarray  # (M,) precision code
    wrapped: np.ndarray  # (M,) bool
    rule: np.ndarray  # (M,) slot in ``rules.rule_paths`` of the deciding rule (0: default)
    _resolution: dict[str, Resolved] | None = field(default=None, init=False, repr=False,
                                                     compare=False)

    def wrappers(self) -> list[Wrapped]:
        """Where apply installs a wrapper, with the deciding rule (for messages)."""
        return [Wrapped(self.tree.paths[j], PRECISIONS[int(self.precision[j])],
                        self.rules.rule_path(int(self.rule[j])))
                for j in np.flatnonzero(self.wrapped)]

    @property
    def format_leaves(self) -> list[str]:
        """Leaves that run a GEMM format (fp8 / mxfp8 / nvfp4)."""
        return [self.tree.paths[j] for j in np.flatnonzero(np.isin(self.precision,
                                                                   FORMAT_CODES))]

    def resolution(self) -> dict[str, Resolved]:
        """Every module path's precision, region and deciding rule (the rule as the
        module's first path), an alias of a shared module resolved as its first path.
        Computed once per plan (the same dict on every call: do not modify it)."""
        if self._resolution is None:
            out: dict[str, Resolved] = {}
            for j, path in enumerate(self.tree.paths):
                out[path] = Resolved(path, PRECISIONS[int(self.precision[j])],
                                     PRECISIONS[int(self.region[j])],
                                     self.rules.rule_path(int(self.rule[j])))
            for alias, first in self.tree.aliases.items():
                r = out[first]
                out[alias] = Resolved(alias, r.precision, r.region, r.rule)
            self._resolution = out
        return self._resolution

    def assignment(self, paths: Iterable[str]) -> dict[str, str]:
        """``{path: precision}`` for ``paths`` (module paths, wrappers' prefixes
        normalised); a path the model does not have is a PolicyError."""
        res = self.resolution()
        out = {}
        for p in paths:
            q = normalize_path(p)
            r = res.get(q)
            if r is None:
                raise PolicyError(f"{self.policy.source}: the model has no module {q!r}")
            out[q] = r.precision
        return out

    def used(self) -> set[str]:
        """Precisions some module computes in."""
        return {PRECISIONS[int(c)] for c in np.unique(self.precision)}

    def warn_unreached(self) -> None:
        """Warn (PolicyWarning) about every GEMM-format rule on a container that decides no
        module: no leaf inside is eligible, or a more specific rule covers each one."""
        decided = set(np.unique(self.rule).tolist())
        slot = {p: k for k, p in enumerate(self.rules.rule_paths) if k}
        parents = {p.rpartition(".")[0] for p in self.tree.paths if p}
        for p, prec in self.policy.layers.items():
            c = self.tree.aliases.get(p, p)
            if prec not in GEMM_FORMATS or c not in parents or slot.get(c) in decided:
                continue  # a format rule on a leaf decides it, or is a validation error
            warn(f"{self.policy.source}: layers[{p!r}]: the {prec} rule reaches no "
                 f"{prec}-eligible Linear layer; everything inside takes "
                 f"{self.resolution()[p].region}")


def compile_plan(policy: Policy, model: torch.nn.Module | ModuleTree) -> ExecutionPlan:
    """Regions, precisions, deciding rules and wrappers of every module of ``model`` under
    ``policy``: the one place a policy is resolved.

    The policy is not validated here (``Policy.validate`` / ``apply_policy`` do that);
    a rule path the model does not have, or two rules naming one shared module with
    different precisions, is a PolicyError naming the rule.
    """
    tree = model if isinstance(model, ModuleTree) else ModuleTree.of(model)
    try:
        return _compile(policy, tree, canonical_rules(policy, tree.aliases))
    except KeyError as err:
        raise PolicyError(f"{policy.source}: layers[{err.args[0]!r}]: the model has no "
                          "such module") from None


def _compile(policy: Policy, tree: ModuleTree, layers: Mapping[str, str]) -> ExecutionPlan:
    rules = RuleSet(tree, list(layers))
    row = rules.codes_of(policy.default, layers)
    region, prec, slot = rules.decide(row[None, :])
    return ExecutionPlan(policy, tree, rules, row, region[0], prec[0],
                         rules._wrapped(region, prec)[0], slot[0])


# -- the policy's resolution on a model, read from its plan -----------------------------

def resolve(policy: Policy, model: torch.nn.Module) -> dict[str, Resolved]:
    """Resolution of every module path of ``model``; a shared module resolves as its first
    path under every alias (one module object, one precision). Compiles the plan: a caller
    that has one reads ``plan.resolution()``."""
    return compile_plan(policy, model).resolution()


def assignment(policy: Policy, model: torch.nn.Module,
               paths: Iterable[str] | None = None) -> dict[str, str]:
    """``{path: precision}`` for the model's GEMM leaves, or for ``paths`` if given.

    ``paths`` lets the cost model ask for every GEMM-bearing node of its LayerGraph
    (attention modules running SDPA in their own code included). Compiles the plan: a
    caller that has one reads ``plan.assignment(paths)``.
    """
    plan = compile_plan(policy, model)
    return plan.assignment(gemm_leaf_paths(model) if paths is None else paths)


def _ancestors(path: str) -> Iterator[str]:
    """``a.b.c``, ``a.b``, ``a``, ``""`` (the root)."""
    yield path
    while path:
        path = path.rpartition(".")[0]
        yield path


def resolve_path(policy: Policy, path: str, module: torch.nn.Module) -> Resolved:
    """The precision ``module`` (at ``path``) computes in under ``policy``, without the
    model: the plan of the chain of ``path``'s ancestors, ``module`` its one leaf.

    ``path`` is taken as written: for a module registered under several paths, ask
    :func:`resolve`, which resolves every alias as the module's first path."""
    chain = list(_ancestors(path))[::-1]  # "", "a", "a.b", path
    ok = [[False] * len(GEMM_FORMATS)] * (len(chain) - 1)
    tree = ModuleTree.build(chain, [False] * len(chain),
                            [*ok, [format_eligible(module, f) for f in GEMM_FORMATS]])
    on_chain = set(chain)
    plan = _compile(policy, tree, {p: v for p, v in policy.layers.items() if p in on_chain})
    return plan.resolution()[path]


__all__ = ["CODE", "ExecutionPlan", "FORMAT_CODES", "ModuleTree", "NO_RULE", "RuleSet",
           "Wrapped", "assignment", "compile_plan", "resolve", "resolve_path"]
