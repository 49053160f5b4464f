"""No import circle between two modules of ``autoprec``, read from the source.

``test_layering`` checks the parts (subpackages); this checks the modules inside them too:
``policy/schema.py`` calling ``policy/modules.py`` while that one imports the schema back is
a circle between two modules of one part, which the part graph cannot see. Every import
counts, as there: module-level ones, lazy ones inside functions and ``TYPE_CHECKING`` blocks.
An import names the module it reaches: ``from autoprec.policy import Policy`` reaches the
package ``autoprec.policy`` (its ``__init__``), ``from autoprec.policy import schema`` the
submodule. The root ``autoprec/__init__.py`` is left out, as in ``test_layering``: it is the
lazy public facade, not a stage.
"""

from __future__ import annotations

from pathlib import Path

from tests.packaging.test_layering import PACKAGE, _cycles, _imported, _module_name


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the other ``autoprec`` modules it imports (the root package left out)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph: dict[str, set[str]] = {m: set() for m in paths if m != top}
    for name in graph:
        for target in _imported(paths[name], root):
            bits = target.split(".")
            # the longest prefix that is a module: `a.b.c` is module a.b.c or a name in a.b
            reached = next((".".join(bits[:k]) for k in range(len(bits), 0, -1)
                            if ".".join(bits[:k]) in paths), None)
            if reached is not None and reached not in (name, top):
                graph[name].add(reached)
    return graph


def _show(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    return "\n".join(
        "  " + " | ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for c in cycles)


def test_no_module_imports_itself_back() -> None:
    graph = module_graph()
    assert len(graph) > 80, "the reader found too few modules to mean anything"
    cycles = _cycles(graph)
    assert cycles == [], f"{len(cycles)} import circle(s) between modules:\n{_show(cycles, graph)}"


def test_the_reader_finds_a_lazy_circle(tmp_path: Path) -> None:
    """The graph sees a circle closed by a function-level import, one closed through a
    ``TYPE_CHECKING`` block, and one closed through a package's ``__init__``; a name
    imported from a module is not taken for a submodule."""
    pkg = tmp_path / "autoprec"
    (pkg / "demo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "demo" / "__init__.py").write_text("from autoprec.demo.c import C\n")
    (pkg / "demo" / "a.py").write_text("def f():\n    from autoprec.demo.b import g\n")
    (pkg / "demo" / "b.py").write_text("from autoprec.demo.a import f\ng = f\n")
    (pkg / "demo" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autoprec.demo import C\n"
        "C = 1\n")
    (pkg / "demo" / "d.py").write_text("from autoprec.demo.c import C\n")  # no circle
    graph = module_graph(pkg)
    assert graph["autoprec.demo.d"] == {"autoprec.demo.c"}
    assert sorted(_cycles(graph)) == [["autoprec.demo", "autoprec.demo.c"],
                                      ["autoprec.demo.a", "autoprec.demo.b"]]
