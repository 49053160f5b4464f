"""Count how the house is laid out, from the source alone (no import of autoprec).

    python scripts/house_counts.py [ROOT ...]       # one column per source tree

ROOT is a checkout (default: this one); to count an older commit, extract it first:
``git archive ce1b2e0 | tar -x -C /tmp/ce1b2e0``. The rows:

- **files in the largest package**: ``.py`` files directly in one subpackage of
  ``autoprec/``; **loose top-level modules**: those directly in ``autoprec/`` but
  ``__init__.py``;
- **files to answer "why this plan"**: the modules on the static call paths from ``tune``
  (the function a reader opens first) to the function that makes the decision (a
  ``decide``), following calls through imported names and ``module.function`` attributes;
- **files that shape the decision's rows**: beyond that call path, the modules that build
  the rows the decision is given (``Row(...)``) or set a field it reads on one
  (``ROW_FIELDS``: feasible, why_not, the estimates and timings), and the one holding
  ``decide`` — what a reader must open to know why each row stood where it did;
- **target-deciding modules**: modules of ``autoprec/`` that decide themselves which
  target a run is for or what it runs as — they use the primitives ``named_target``,
  ``canonical_target``, ``DEFAULT_TARGET``, ``mode_of``, ``speed_source`` or
  ``best_fp8_backend`` (the modules defining them included) rather than being handed a
  resolved ``Target`` (calling ``resolve_target`` is asking the one place, not deciding);
- **private names imported across packages**: ``from autoprec.x import _name`` where the
  importing file is not in ``autoprec.x``'s own folder (in ``autoprec/``, ``experiments/``,
  ``benchmarks/``, ``scripts/``; tests counted apart);
- **one-off scripts in experiments/**: top-level ``experiments/*.py`` that no test names;
- **public names**: ``autoprec.__all__`` as written in ``autoprec/__init__.py``;
- **README lines**.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_NAMES = {"named_target", "canonical_target", "speed_source", "mode_of",
                "DEFAULT_TARGET", "best_fp8_backend"}


def _modname(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for p in sorted((root / "autoprec").rglob("*.py")):
        out[_modname(p, root)] = (p, ast.parse(p.read_text(), str(p)))
    return out


def _imports(name: str, path: Path, tree: ast.Module) -> dict[str, str]:
    """local name -> the dotted thing it stands for, from every import in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    got: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                got[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                got[a.asname or a.name] = f"{base}.{a.name}"
    return got


def package_sizes(mods: dict[str, tuple[Path, ast.Module]]) -> dict[str, int]:
    """folder of ``autoprec/`` ("" for the top level) -> its ``.py`` files (not below)."""
    count: dict[str, int] = defaultdict(int)
    for name, (path, _t) in mods.items():
        parts = name.split(".")
        folder = "/".join(parts[1:-1]) if path.name != "__init__.py" else "/".join(parts[1:])
        count[folder] += 1
    return dict(count)


def loose_modules(mods: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """The modules directly in ``autoprec/`` (``__init__`` left out)."""
    return sorted(name.split(".")[1] for name, (path, _t) in mods.items()
                  if name.count(".") == 1 and path.name != "__init__.py")


def largest_package(mods: dict[str, tuple[Path, ast.Module]]) -> tuple[str, int]:
    sizes = {k: v for k, v in package_sizes(mods).items() if k}
    name = max(sizes, key=lambda k: sizes[k])
    return name + "/", sizes[name]


def _functions(mods: dict[str, tuple[Path, ast.Module]]) -> dict[str, tuple[str, ast.AST]]:
    """"module.function" (and "module.Class.method") -> (module, its def)."""
    out: dict[str, tuple[str, ast.AST]] = {}
    for name, (_p, tree) in mods.items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[f"{name}.{node.name}"] = (name, node)
            elif isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef):
                        out[f"{name}.{node.name}.{sub.name}"] = (name, sub)
    return out


def call_graph(mods: dict[str, tuple[Path, ast.Module]]) -> dict[str, set[str]]:
    funcs = _functions(mods)
    graph: dict[str, set[str]] = defaultdict(set)
    for qual, (mod, node) in funcs.items():
        path, tree = mods[mod]
        names = _imports(mod, path, tree)
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            target = None
            if isinstance(f, ast.Name):
                target = names.get(f.id, f"{mod}.{f.id}")
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                base = names.get(f.value.id)
                if base is not None:
                    target = f"{base}.{f.attr}"
                elif f.value.id in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}:
                    target = f"{mod}.{f.value.id}.{f.attr}"
            if target in funcs:
                graph[qual].add(target)
    return graph


def why_this_plan(mods: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Modules on call paths from ``tune`` (the function) to the one that decides."""
    graph = call_graph(mods)
    funcs = _functions(mods)
    start = [q for q in funcs if q.endswith(".tune.tune")]
    goal = {q for q in funcs if q.endswith(".decide")}
    reach: set[str] = set()
    stack = list(start)
    while stack:
        q = stack.pop()
        if q in reach:
            continue
        reach.add(q)
        stack.extend(graph.get(q, ()))
    back: dict[str, set[str]] = defaultdict(set)
    for a, bs in graph.items():
        for b in bs:
            back[b].add(a)
    to_goal: set[str] = set()
    stack = [g for g in goal if g in reach]
    while stack:
        q = stack.pop()
        if q in to_goal:
            continue
        to_goal.add(q)
        stack.extend(back.get(q, ()))
    on_path = reach & to_goal
    return sorted({funcs[q][0] for q in on_path})


#: A row's fields the decision reads (``evaluation.rows.Row``): a module that sets one, or
#: builds a ``Row``, shapes what is decided.
ROW_FIELDS = {"feasible", "why_not", "est_speedup", "speedup", "p10", "p90", "same_as",
              "warm", "faults", "est_measured_batch", "error"}


def row_shapers(mods: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Every file that shapes "why this plan" beyond the call path: the modules that build
    the rows or set what the decision reads on them (``_row_builders``), and those that
    pick among rows or candidates or define a constant of the decision's (``_pickers``)."""
    return sorted(set(_row_builders(mods)) | set(_pickers(mods)))


#: The decision's constants: a module defining one of its own shapes the choice too.
RULE_CONSTANTS = {"SAME_SPEED", "SLOW_TO_TIME", "NEXT_CANDIDATES", "MAX_TRIES",
                  "RETIME_MARGIN"}
#: What a pick among rows or candidates ranks them by.
RANKED_BY = {"calib", "est_speedup", "speedup", "est_time"}


def _pickers(mods: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Modules that pick among rows or candidates themselves (a ``min``/``max`` whose key
    reads ``RANKED_BY``) or define a constant of the decision's (``RULE_CONSTANTS``)."""
    out = []
    for name, (_path, tree) in mods.items():
        consts = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name)}
        picks = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("min", "max")
            and any(k.arg == "key" and any(isinstance(a, ast.Attribute) and a.attr in RANKED_BY
                                           for a in ast.walk(k.value)) for k in n.keywords)
            for n in ast.walk(tree))
        if picks or consts & RULE_CONSTANTS:
            out.append(name)
    return out


def _row_builders(mods: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Modules that handle the decision's rows (import ``evaluation.rows``, ``decision`` or
    ``reasons``, or are one of them) and build one (``Row(...)``) or set a field the
    decision reads on one (``ROW_FIELDS``, on anything but ``self``), and the module holding
    ``decide``."""
    handles = ("autoprec.evaluation.rows", "autoprec.evaluation.decision",
               "autoprec.evaluation.reasons")
    out = []
    for name, (path, tree) in mods.items():
        if name in handles[1:] and any(isinstance(n, ast.FunctionDef) and n.name == "decide"
                                       for n in tree.body):
            out.append(name)
            continue
        if name not in handles and not any(v.startswith(handles) or v in handles
                                           for v in _imports(name, path, tree).values()):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                hit = (isinstance(f, ast.Name) and f.id == "Row") or (
                    isinstance(f, ast.Attribute) and f.attr == "Row")
            elif isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                flat = [e for t in targets
                        for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                hit = any(isinstance(t, ast.Attribute) and t.attr in ROW_FIELDS
                          and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                          for t in flat)
            else:
                continue
            if hit:
                out.append(name)
                break
    return sorted(out)


def target_deciders(mods: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    out = []
    for name, (_path, tree) in mods.items():
        defined = {n.name for n in tree.body
                   if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if (used | defined) & TARGET_NAMES:
            out.append(name)
    return sorted(out)


def private_imports(root: Path, folders: list[str]) -> list[str]:
    hits = []
    for folder in folders:
        for p in sorted((root / folder).rglob("*.py")) if (root / folder).exists() else []:
            try:
                tree = ast.parse(p.read_text(), str(p))
            except SyntaxError:
                continue
            here = ".".join(p.relative_to(root).parent.parts)
            for node in ast.walk(tree):
                if (isinstance(node, ast.ImportFrom) and node.module
                        and node.module.startswith("autoprec")):
                    pkg = node.module.rpartition(".")[0]
                    for a in node.names:
                        if a.name.startswith("_") and not a.name.startswith("__") and pkg != here:
                            hits.append(f"{p.relative_to(root)}: {node.module}.{a.name}")
    return hits


def one_off_scripts(root: Path) -> list[str]:
    tests = "\n".join(p.read_text() for p in (root / "tests").rglob("*.py"))
    return sorted(p.name for p in (root / "experiments").glob("*.py")
                  if p.stem not in tests)


def public_names(root: Path) -> int:
    tree = ast.parse((root / "autoprec/__init__.py").read_text())
    exports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            ns: dict[str, object] = {}
            for n in tree.body:  # __all__ may be built from _EXPORTS
                if isinstance(n, ast.Assign | ast.AnnAssign):
                    with contextlib.suppress(Exception):  # only literal assignments matter
                        exec(compile(ast.Module([n], []), "<init>", "exec"), {}, ns)
            return len(ns.get("__all__", exports))  # type: ignore[arg-type]
    return 0


def counts(root: Path) -> dict[str, str]:
    mods = _modules(root)
    pkg, n = largest_package(mods)
    why = why_this_plan(mods)
    return {
        "files in the largest package": f"{n} ({pkg})",
        "loose top-level modules": str(len(loose_modules(mods))),
        'files to answer "why this plan"': str(len(why)),
        "files that shape the decision's rows": str(len(row_shapers(mods))),
        "target-deciding modules": str(len(target_deciders(mods))),
        "private names imported across packages (package, experiments, scripts)":
            str(len(private_imports(root, ["autoprec", "experiments", "benchmarks",
                                           "scripts", "examples"]))),
        "private names imported across packages (tests)":
            str(len(private_imports(root, ["tests"]))),
        "one-off scripts in experiments/": str(len(one_off_scripts(root))),
        "public names (autoprec.__all__)": str(public_names(root)),
        "README lines": str(len((root / "README.md").read_text().splitlines())),
    }


def main() -> int:
    roots = [Path(a) for a in sys.argv[1:] if not a.startswith("-")] or [ROOT]
    verbose = "-v" in sys.argv
    cols = [counts(r) for r in roots]
    w = max(len(k) for k in cols[0])
    print(f"| {'count':<{w}} | " + " | ".join(str(r) for r in roots) + " |")
    print(f"|{'-' * (w + 2)}|" + "|".join("-" * (len(str(r)) + 2) for r in roots) + "|")
    for k in cols[0]:
        print(f"| {k:<{w}} | " + " | ".join(c[k].ljust(len(str(r)))
                                           for c, r in zip(cols, roots, strict=True)) + " |")
    if verbose:
        for r in roots:
            mods = _modules(r)
            print(f"\n{r}:\n  why this plan: {', '.join(why_this_plan(mods))}"
                  f"\n  shape the rows: {', '.join(row_shapers(mods))}"
                  f"\n  target-deciding: {', '.join(target_deciders(mods))}"
                  f"\n  loose top-level modules: {', '.join(loose_modules(mods))}")
            for h in private_imports(r, ["autoprec", "experiments", "benchmarks", "scripts",
                                         "examples", "tests"]):
                print(f"  private: {h}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
