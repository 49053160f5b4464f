"""One TuneConfig from the command line to the writer, validated once (tuning/config.py).

A bad value through the CLI is one line and exit 2 before anything runs (no model load,
no study, no policy); a good tune checks its options exactly once although the CLI,
``tune`` and the writer all read the config.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import autoprec.tuning.config as config_mod
import autoprec.tuning.tune as tune_mod
from autoprec.errors import InputError
from autoprec.policy import load_policy
from autoprec.tuning.config import OPTIONS, TuneConfig
from tests.helpers import TRAP, run_cli

QUICK = ["--target", "h100", "--batch-size", "65536", "--precisions", "bf16,fp16",
         "--no-track", "--quiet"]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--trials", "0", "--trials: must be >= 1"),
    ("--max-error", "-1", "--max-error: must be >= 0"),
    ("--precisions", "fp64", "--precisions"),
    ("--form", "fast", "--form must be one of"),
    ("--max-weight-mb", "-3", "--max-weight-mb must be a positive number of megabytes"),
    ("--memory-limit", "0", "--memory-limit must be a positive number of gigabytes"),
    ("--min-speedup", "0", "--min-speedup: must be a finite number > 0"),
    ("--seed", "-1", "--seed: must be an integer"),
    ("--target", "nope", "unknown target device 'nope'"),
    ("--patience", "0", "--patience: must be >= 1"),
    ("--timeout", "nan", "--timeout: must be a finite number of seconds"),
])
def test_a_bad_value_is_one_line_and_exit_2_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        option: str, value: str, says: str) -> None:
    monkeypatch.chdir(tmp_path)

    def no_work(*a: object, **k: object) -> None:
        raise AssertionError("tune started work for a bad option")

    monkeypatch.setattr(tune_mod, "prepare", no_work)
    args = ["tune", TRAP, *QUICK, "--out", tmp_path / "p.yaml", option, value]
    if option == "--precisions":
        args.remove("bf16,fp16")
        args.remove("--precisions")
    code, out, err = run_cli(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (out, err)
    assert lines[0].startswith("autoprec: error: ") and says in lines[0], lines[0]
    assert not list(tmp_path.rglob("*.yaml")) and not list(tmp_path.rglob("*.db"))


def test_a_tune_through_the_cli_checks_its_options_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    calls: list[object] = []
    real = config_mod.check_budget

    def counted(*a: object) -> None:
        calls.append(a)
        real(*a)

    monkeypatch.setattr(config_mod, "check_budget", counted)
    seen: list[TuneConfig] = []
    real_write = tune_mod.write

    def write(prep, space, search, cfg, *rest):  # the writer reads the same config
        seen.append(cfg)
        return real_write(prep, space, search, cfg, *rest)

    monkeypatch.setattr(tune_mod, "write", write)
    out = tmp_path / "p.yaml"
    code, _, err = run_cli(["tune", TRAP, *QUICK, "--trials", "2", "--max-error", "0.01",
                            "--out", out], capsys)
    assert code == 0, err
    assert len(calls) == 1  # validated once: the CLI's; tune and the writer trust it
    (cfg,) = seen
    assert cfg.is_validated and cfg.search.trials == 2
    assert cfg.search.precisions == ("fp32", "bf16", "fp16")
    assert cfg.output.out == out and cfg.budget.value == 0.01 and cfg.pricing.target == "h100"
    assert load_policy(out).target["device"] == "h100"


def test_the_python_api_takes_the_config_or_its_options() -> None:
    cfg = TuneConfig(max_drop=0.02, target="CPU", precisions="bf16", trials=3, out="p.yaml")
    done = cfg.validated()
    assert not cfg.is_validated and done.is_validated and done.validated() is done
    assert (done.pricing.target, done.search.precisions, done.budget.value,
            done.budget.name) == ("cpu", ("fp32", "bf16"), 0.02, "max_drop")
    assert done.pricing.form == "deploy" and done.output.out == Path("p.yaml")
    assert done.with_seed(7).is_validated and done.with_seed(7).search.seed == 7
    assert done.option("trials") == 3 and done.search.trials == 3
    with pytest.raises(InputError, match="^trials: must be >= 1"):  # the keyword, in Python
        TuneConfig(trials=0).validated()
    with pytest.raises(InputError, match="^--trials: must be >= 1"):  # the flag, in the CLI
        TuneConfig(trials=0).validated(cli=True)
    with pytest.raises(TypeError, match="not both"):
        tune_mod.tune(TRAP, cfg, trials=3)
    with pytest.raises(TypeError):
        tune_mod.tune(TRAP, trails=3)  # a misspelt option is no silent default
    # ``tune``'s keywords are the config's fields, one list
    assert "memory_limit_gb" in OPTIONS and "report" in OPTIONS and "_valid" not in OPTIONS


def test_the_config_is_six_concerns_each_flag_in_one() -> None:
    """Each option belongs to one concern; a concern may be given whole; both at once, an
    unknown option or a wrong type is a TypeError."""
    from autoprec.tuning.config import (
        CONCERNS,
        OPTION_OF,
        Budget,
        SearchOptions,
    )

    assert set(CONCERNS) == {"budget", "pricing", "search", "study", "train_check", "output"}
    assert OPTION_OF["max_error"] == "budget" and OPTION_OF["trials"] == "search"
    assert OPTION_OF["storage"] == "study" and OPTION_OF["train_lr"] == "train_check"
    assert OPTION_OF["form"] == "pricing" and OPTION_OF["report"] == "output"
    cfg = TuneConfig(search=SearchOptions(trials=5), budget=Budget(max_error=0.02))
    assert cfg.search.trials == 5 and cfg.budget.value == 0.02 and cfg.pricing.target == "h100"
    assert cfg == TuneConfig(trials=5, max_error=0.02)
    with pytest.raises(TypeError, match="not both"):
        TuneConfig(search=SearchOptions(), trials=3)
    with pytest.raises(TypeError, match="unknown option 'trails'"):
        TuneConfig(trails=3)
    with pytest.raises(TypeError, match="must be a SearchOptions"):
        TuneConfig(search={"trials": 3})
    with pytest.raises(InputError, match="^max_error"):
        TuneConfig(max_error=-1).validated()
