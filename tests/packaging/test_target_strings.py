"""No stage parses a target or device name: it asks ``autoprec.device.targets``.

Read from the source (an AST walk, lazy code included): outside ``autoprec/device/targets.py`` no
code may take a target name ("h100", "cpu", "cpu-<key>") or a device string ("cuda:1")
apart itself — ``device.split(":")``, ``name.startswith("cuda")``, ``device == "cpu"``,
``kind in ("cpu", "cuda")``. Each of those was written in cost/machine, cost/measure,
search/speed_source and search/timing, now evaluation/ (issue 30), and each could disagree with the others
on what "cuda" or "cpu-3f2a" means; a stage asks ``targets.is_cpu`` / ``device_kind`` /
``cuda_index`` / ``device_type`` / ``is_cpu_target`` instead.

Not under the rule: a comparison whose other side is a *device type* — ``t.device.type``
(a ``torch.device``'s, which torch has already parsed: it says where a tensor lives, not
which target a plan is for), or a value named ``*type`` / a call of ``*type`` /
``*type_of`` (``targets.device_type``'s answer: the two-word vocabulary ``torch.autocast``
itself takes). Comparing the answer is not parsing the name. Naming "cpu" as data is fine
too: ``torch.device("cpu")``, a dict key, a default argument, a docstring.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.packaging.test_format_strings import _literals, scan
from tests.packaging.test_layering import PACKAGE as ROOT

#: The device words a decision may not compare a name with.
WORDS = frozenset({"cpu", "cuda"})
#: Where target and device names are parsed: the one module that knows what they mean.
OWNER = "device/targets.py"
#: Files besides the owner allowed to parse names, each with why (none today).
ALLOWED: dict[str, str] = {}


def _is_device_type(node: ast.AST) -> bool:
    """``x.type``, ``device_type``, ``self.target_type``, ``device_type_of(profile)``: a
    device type already parsed (see the module doc)."""
    if isinstance(node, ast.Call):
        node = node.func
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        return name.endswith(("type", "type_of"))
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return isinstance(name, str) and name.endswith("type")


def _device_prefix(s: str) -> bool:
    return any(s.startswith(w) or w.startswith(s) for w in WORDS) and bool(s)


def target_parsing(path: Path) -> Iterator[tuple[int, str]]:
    """(line, source) of every place ``path`` takes a target or device name apart."""
    src = path.read_text()
    for node in ast.walk(ast.parse(src, str(path))):
        hit = False
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            hit = (any(s in WORDS for side in sides for s in _literals(side))
                   and not any(_is_device_type(side) for side in sides))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            lits = list(_literals(node.args[0]))
            if node.func.attr in ("split", "rsplit"):
                hit = ":" in lits
            elif node.func.attr in ("startswith", "endswith", "removeprefix"):
                hit = any(_device_prefix(s) for s in lits)
        if hit:
            yield node.lineno, ast.get_source_segment(src, node) or ""


def offenders(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """``{file: [(line, code)]}`` outside the owner and the allow-list."""
    return scan(root, target_parsing, lambda rel: rel == OWNER or rel in ALLOWED)


def test_no_stage_parses_a_target_or_device_name() -> None:
    bad = offenders()
    assert not bad, "ask autoprec.device.targets (is_cpu, device_kind, cuda_index, device_type):\n" \
        + "\n".join(f"  autoprec/{f}:{line}: {code}" for f, hits in bad.items()
                    for line, code in hits)


def test_the_owner_exists_and_the_allow_list_names_files_that_do() -> None:
    assert (ROOT / OWNER).is_file()
    for rel in ALLOWED:
        assert (ROOT / rel).is_file() and rel != OWNER, rel


def test_the_reader_finds_each_kind_of_parsing(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "stage.py").write_text(
        "def f(device, name, t, dev):\n"
        "    a = device == 'cpu'\n"
        "    b = device.split(':', 1)[0]\n"
        "    c = name.startswith('cuda')\n"
        "    d = b not in ('cpu', 'cuda')\n"
        "    e = 'cuda' != name\n"
        "    g = name.startswith('cpu-')\n"
        "    ok = (dev.type == 'cuda', device_type == 'cpu', t.device_type != 'cuda',\n"
        "          device_type_of(name) == 'cpu', torch.device('cpu'), {'cpu': 1}.get(name),\n"
        "          name.split(','), name.startswith('h1'), target_type == 'cuda')\n"
        "    return a, b, c, d, e, g, ok\n")
    (pkg / "device").mkdir()
    (pkg / "device" / "targets.py").write_text(
        "def is_cpu(d):\n    return d.split(':')[0] == 'cpu'\n")
    assert [line for line, _ in offenders(pkg)["stage.py"]] == [2, 3, 4, 5, 6, 7]
    assert "device/targets.py" not in offenders(pkg)
