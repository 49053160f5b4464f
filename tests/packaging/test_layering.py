"""The package's layering, read from the source: which part of ``autoprec`` imports which.

A *part* is a subpackage (``autoprec.probe``) or a top-level module (``autoprec.api``).
Every import counts: module-level, lazy ones inside functions and ``TYPE_CHECKING`` blocks
(a lazy import is still a dependency, only a later one). The root ``autoprec/__init__.py``
is left out: it is the public facade, re-exporting every stage lazily, and
``from autoprec import __version__`` reads a constant, not a stage.

The rules (STYLE.md, "the folders show the flow"): the foundations (the number formats and
precisions, the lowering of a module to a precision, the device facts, the user-boundary
helpers, the workload, the errors, torch.nn's fused paths) sit below every stage; the stages
trace -> probe -> plan -> cost -> measure -> evaluation -> search -> study -> tuning ->
apply -> track never import a later one, except where ``LATER_ALLOWED`` says; training
under a policy sits beside ``apply``, and nothing before ``apply`` imports either; nearly
everything lives in a package (``LOOSE``: the few top-level modules); and no part imports
itself back through another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "autoprec"

#: The stages in the order the data flows through them.
#: ``measure`` runs ops on this machine (latency, the model's op times, a real training
#: step, the calibration's micro-benchmarks): above the cost, whose records (``OpTimes``,
#: a fitted profile) it fills; the cost stage prices what it is handed and never runs ops.
#: Above them: ``evaluation`` (what tune, check and eval share: the target, scoring,
#: baselines, timing, the decision), ``search`` (the algorithm alone: no Optuna, no files),
#: ``study`` (the Optuna adapter) and ``tuning`` (tune's orchestration on top).
STAGES = ("trace", "probe", "plan", "cost", "measure", "evaluation", "search", "study", "tuning",
          "apply", "track")
#: Later stages an earlier one may import: the evaluation scores and times plans by
#: applying them (``Target.apply``, the audit), and tune logs its trials (``track``).
LATER_ALLOWED = {("evaluation", "apply"), ("tuning", "apply"), ("tuning", "track")}
#: Parts below every stage: they import no stage (and no policy). ``formats`` holds the
#: precisions too; ``device`` the target names and the capability check; ``io`` files,
#: paths, argument checks and optional dependencies; ``workload`` the model and data a
#: command works on and their error against the fp32 reference; ``stream`` a checkpoint
#: folder's model streamed block by block (the workload's model when it is larger than
#: memory).
FOUNDATIONS = ("formats", "lower", "device", "io", "workload", "stream", "errors", "fused")
#: The only modules directly in ``autoprec/``: the public entry points (``api``: tune,
#: check and evaluate for the model in hand; ``errors``: the root exception) and ``fused``
#: (torch.nn's fused paths: below ``formats``, which asks it which children never run, and
#: above nothing else, so no package can hold it without an import circle) and ``_version``
#: (the version string: what records it imports it there, not the package root).
LOOSE = ("_version", "api", "errors", "fused")


def _parts() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(path: Path, root: Path = PACKAGE) -> Iterator[str]:
    """Every name ``path`` imports: ``from a.b import c`` gives ``a.b.c``."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            yield from (f"{base}.{a.name}" for a in node.names)


def import_graph() -> dict[str, set[str]]:
    """part -> the other parts it imports (the root package left out, see above)."""
    parts = _parts()
    graph: dict[str, set[str]] = {p: set() for p in parts}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name == "autoprec":
            continue
        src = name.split(".")[1]
        for target in _imported(path):
            bits = target.split(".")
            if bits[0] == "autoprec" and len(bits) > 1 and bits[1] in parts and bits[1] != src:
                graph[src].add(bits[1])
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _show(graph: dict[str, set[str]]) -> str:
    return "\n".join(f"  {p} -> {', '.join(sorted(graph[p])) or '-'}" for p in sorted(graph))


def test_no_part_imports_itself_back() -> None:
    graph = import_graph()
    assert _cycles(graph) == [], f"import cycles between parts; the graph:\n{_show(graph)}"


def test_stages_import_no_later_stage() -> None:
    graph = import_graph()
    later = {(a, b) for i, a in enumerate(STAGES) for b in STAGES[i + 1:] if b in graph[a]}
    assert later <= LATER_ALLOWED, (
        f"an earlier stage imports a later one: {sorted(later - LATER_ALLOWED)}; "
        f"the graph:\n{_show(graph)}")


def test_nothing_before_apply_imports_apply() -> None:
    """Nor training under a policy, which applies it (``training`` imports ``apply``)."""
    graph = import_graph()
    assert "apply" in graph["training"], _show(graph)
    before = ("trace", "policy", "probe", "plan", "cost", "measure", *FOUNDATIONS)
    offenders = sorted((p, q) for p in before for q in ("apply", "training")
                       if q in graph.get(p, ()))
    assert offenders == [], f"{offenders} import a later part; the graph:\n{_show(graph)}"


def test_the_loose_modules_are_the_few_named() -> None:
    """A new module joins the package of what it holds; only ``LOOSE`` sits at the top."""
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert loose == sorted(LOOSE), f"loose top-level modules: {loose}; expected {LOOSE}"


def test_foundations_import_no_stage() -> None:
    graph = import_graph()
    stages = set(STAGES) | {"policy"}
    found = {p: sorted(graph.get(p, set()) & stages) for p in FOUNDATIONS
             if graph.get(p, set()) & stages}
    assert found == {}, f"below every stage, yet imports stages: {found}"


def test_the_reader_sees_lazy_imports(tmp_path: Path) -> None:
    """The graph counts an import inside a function, and resolves a relative one."""
    pkg = tmp_path / "autoprec" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    mod = pkg / "m.py"
    mod.write_text("def f():\n    from autoprec.apply.x import y\n"
                   "from . import sibling\nimport autoprec.trace.graph\n")
    assert set(_imported(mod, tmp_path / "autoprec")) == {
        "autoprec.apply.x.y", "autoprec.demo.sibling", "autoprec.trace.graph"}


def test_check_and_eval_run_without_the_search() -> None:
    """What tune, check and eval share (``autoprec.evaluation``: the target, assess, the
    baselines, the timing, the decision, check and eval themselves) imports nothing of
    the search, its Optuna adapter or tune's orchestration."""
    graph = import_graph()
    assert graph["evaluation"] & {"search", "study", "tuning"} == set(), _show(graph)
    assert "optuna" not in {m.split(".")[0] for p in (PACKAGE / "search").glob("*.py")
                            for m in _imported(p)}, "the search algorithm imports Optuna"


def test_measure_is_used_through_its_interface() -> None:
    """Code that runs ops on this machine sits behind ``autoprec.measure``'s exports: no
    other part imports one of its submodules (``autoprec.measure.ops``, ``.op_runner``)."""
    reached = sorted(
        f"{path.relative_to(PACKAGE.parent)} -> {target}"
        for path in PACKAGE.rglob("*.py") if path.parent.name != "measure"
        for target in _imported(path)
        if target.startswith("autoprec.measure.")
        and target.split(".")[2] not in _measure_exports())
    assert reached == [], f"past autoprec.measure's interface: {reached}"


def _measure_exports() -> set[str]:
    import autoprec.measure

    return set(autoprec.measure.__all__)
