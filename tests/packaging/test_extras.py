"""A missing optional dependency is one line naming the extra to install, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoprec.io.extras import EXTRAS, MissingExtra, installed, require
from autoprec.track import make_tracker
from tests.helpers import MODELS, ROOT, run_cli

MLP = MODELS / "mlp.py"


def _uninstall(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    # A None entry in sys.modules makes the import fail and find_spec answer None, as for a
    # package that is not installed.
    monkeypatch.setitem(sys.modules, module, None)


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _uninstall(monkeypatch, "psycopg2")
    assert not installed("psycopg2")
    with pytest.raises(MissingExtra, match=r"pip install 'autoprec\[postgres\]'") as err:
        require("psycopg2", "--storage postgresql://")
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    require("torch", "anything")  # installed: no error


def test_every_extra_module_is_in_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for extra in set(EXTRAS.values()):
        assert f"\n{extra} = [" in text, extra


def test_tracker_without_mlflow_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    _uninstall(monkeypatch, "mlflow")
    with pytest.raises(MissingExtra, match=r"autoprec\[mlflow\]'.*--no-track"):
        make_tracker(None, "autoprec", workdir=tmp_path)
    assert not make_tracker(None, "autoprec", enabled=False).enabled


def test_tune_without_mlflow_exits_2_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _uninstall(monkeypatch, "mlflow")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["tune", MLP, "--trials", "2", "--out", tmp_path / "p.yaml",
                            "--quiet"], capsys)
    assert code == 2
    assert err.strip().splitlines() == ["autoprec: error: MLflow tracking needs mlflow, which is not installed: "
                   "pip install 'autoprec[mlflow]' (or turn it off: --no-track)"]
    assert not (tmp_path / "p.yaml").exists()
