"""No stage compares GEMM-format names: it asks the format object (``autoprec.formats.gemm``).

Read from the source (an AST walk, lazy code included): outside ``autoprec/formats/`` (the
formats themselves) and ``autoprec/lower/`` (the backends that dispatch on them), no
comparison may hold a GEMM-format name as a literal — ``p == "nvfp4"``, ``p in ("fp8",
"mxfp8")``, ``{"fp8", ...} <= names`` — and no ``str.startswith`` / ``endswith`` may test a
prefix only a format name has (``p.startswith("mx")``). A stage that needs to know whether a
precision trains, is block-scaled, how many bytes it stores or what its quantisation costs
asks ``format_of(p)`` / ``gemm_format(p)`` (``is_forward_only``, ``is_block_scaled``), and
a new format then reaches every stage by its object alone.

Naming a format is still fine where it is data, not a decision: a dict key (a colour in a
plot), a call argument (``capability("fp8", "torch", device)``), a docstring.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from autoprec.formats.gemm import GEMM_FORMAT_BY_NAME
from autoprec.formats.precisions import PRECISIONS, REGIONS
from tests.packaging.test_layering import PACKAGE

#: The format names a decision may not spell (every GEMM format autoprec has, and the MX
#: names a new one would likely take).
NAMES = frozenset(GEMM_FORMAT_BY_NAME) | {"mxfp4", "mxfp6"}
#: Where a format's name is the subject: the formats and the backends that run them.
OWNERS = ("formats", "lower")
#: Files outside those allowed to compare format names, each with why (none today: the
#: precision vocabulary, ``formats/precisions.py``, lives with the formats).
ALLOWED: dict[str, str] = {}


def _format_prefix(s: str) -> bool:
    """A prefix only GEMM-format names have (``"mx"``, ``"nv"``, ``"fp8"``), not a region's."""
    return bool(s) and any(n.startswith(s) for n in NAMES) and \
        not any(r.startswith(s) for r in REGIONS)


def _literals(node: ast.AST) -> Iterator[str]:
    """The string constants of ``node``: itself, the key of a subscript (``CODE["fp8"]``),
    or the elements of a tuple/list/set literal (also inside ``frozenset({...})`` /
    ``set(...)`` / ``tuple(...)``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Subscript):
        yield from _literals(node.slice)
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            yield from _literals(e)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("frozenset", "set", "tuple") and node.args:
        yield from _literals(node.args[0])


def format_compares(path: Path) -> Iterator[tuple[int, str]]:
    """(line, source) of every comparison against a GEMM-format literal in ``path``."""
    src = path.read_text()
    for node in ast.walk(ast.parse(src, str(path))):
        if isinstance(node, ast.Compare):
            if any(s in NAMES for side in (node.left, *node.comparators) for s in _literals(side)):
                yield node.lineno, ast.get_source_segment(src, node) or ""
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith", "removeprefix") and node.args
              and any(_format_prefix(s) for s in _literals(node.args[0]))):
            yield node.lineno, ast.get_source_segment(src, node) or ""


def scan(root: Path, find: Callable[[Path], Iterable[tuple[int, str]]],
         skip: Callable[[str], bool]) -> dict[str, list[tuple[int, str]]]:
    """``{file: [(line, code)]}`` of what ``find`` reports in every module below ``root``
    whose relative path ``skip`` does not exempt (the packaging checks share it)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not skip(rel) and (found := sorted(find(path))):
            out[rel] = found
    return out


def offenders(root: Path = PACKAGE) -> dict[str, list[tuple[int, str]]]:
    """``{file: [(line, comparison)]}`` outside the owners and the allow-list."""
    return scan(root, format_compares,
                lambda rel: rel.split("/")[0] in OWNERS or rel in ALLOWED)


def test_no_stage_compares_gemm_format_names() -> None:
    bad = offenders()
    assert not bad, "compare the format object, not its name (format_of / gemm_format):\n" + \
        "\n".join(f"  autoprec/{f}:{line}: {code}" for f, hits in bad.items()
                  for line, code in hits)


def test_the_allow_list_names_files_that_exist_outside_the_owners() -> None:
    for rel in ALLOWED:
        assert (PACKAGE / rel).is_file() and rel.split("/")[0] not in OWNERS, rel
    assert set(NAMES) >= set(PRECISIONS) - set(REGIONS)


def test_the_reader_finds_each_kind_of_comparison(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "lower").mkdir(parents=True)
    (pkg / "stage.py").write_text(
        "def f(p, names):\n"
        "    a = p == 'nvfp4'\n"
        "    b = p in ('fp8', 'bf16')\n"
        "    c = p not in frozenset({'mxfp8'})\n"
        "    d = {'nvfp4', 'fp8'} <= set(names)\n"
        "    e = p.startswith('mx')\n"
        "    g = code == CODE['fp8']\n"
        "    ok = p == 'bf16' or p.startswith('fp') or {'fp8': 1}.get(p)\n"
        "    return a, b, c, d, e, g, ok\n")
    (pkg / "lower" / "backend.py").write_text("def g(p):\n    return p == 'fp8'\n")
    assert [line for line, _ in offenders(pkg)["stage.py"]] == [2, 3, 4, 5, 6, 7]
    assert "lower/backend.py" not in offenders(pkg)
