"""``autoprec show`` lists rules in the file's order (tune writes model order), or with
``--model`` in the model's module order — never alphabetically."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import TRAP, run_cli

# trap's modules run inp, blow, norm1, mid1, offset, norm2, mid2, head; the file says
# otherwise, and alphabetical order would be a third order.
POLICY = """autoprec_policy: 1
default: fp32
layers: {mid2: fp16, head: fp16, inp: bf16, blow: bf16}
locked: [offset]
reasons: {blow: "fp16: overflow"}
"""


def _rows(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line.split()[0])
    return rows


def _show(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, out, err = run_cli(["show", *args], capsys)
    assert code == 0, err
    return out


def test_show_keeps_the_file_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    assert _rows(_show([str(path)], capsys)) == ["mid2", "head", "inp", "blow", "offset"]


def test_show_with_model_uses_module_order(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    rows = _rows(_show([str(path), "--model", str(TRAP)], capsys))
    assert rows == ["inp", "blow", "offset", "mid2", "head"]


def test_show_with_model_refuses_a_path_the_model_lacks(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("autoprec_policy: 1\ndefault: fp32\nlayers: {nope: bf16}\n")
    code, _, err = run_cli(["show", path, "--model", TRAP], capsys)
    assert code == 2 and "nope" in err


def test_show_with_model_of_another_structure_warns_without_claiming_it_forced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """show lists a mismatched policy (a review, nothing is applied) and says eval and
    check refuse it; it does not say "applied anyway (forced)" when --force was not given."""
    path = tmp_path / "p.yaml"
    path.write_text(POLICY + 'model: {fingerprint: "sha256:' + "0" * 64 + '"}\n')
    code, out, err = run_cli(["show", path, "--model", TRAP], capsys)
    assert code == 0 and _rows(out)[0] == "inp"
    (line,) = err.strip().splitlines()
    assert "does not match the model" in line and "listed for review" in line, line
    assert "applied anyway" not in line and "forced)" not in line
