"""Policy files: schema 1, validation messages (file, key, rule), atomic saving."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from autoprec.errors import InputError, PolicyError
from autoprec.policy import SCHEMA_VERSION, Policy, load_policy, loads_policy

GOLDEN = Path(__file__).parent / "golden"
PRECS = "expected one of fp32, tf32, bf16, fp16, fp8"


def test_golden_full_file_loads_unchanged() -> None:
    p = load_policy(GOLDEN / "schema1_full.yaml")
    assert p.default == "fp32"
    assert p.layers == {
        "encoder.layer.0.attention": "bf16",
        "encoder.layer.0.attention.self.query": "fp8",
        "0": "fp16",
        "head": "tf32",  # `_orig_mod.` (torch.compile's prefix) normalised away
    }
    assert p.model_name == "trap" and p.fingerprint.startswith("sha256:0123")
    assert p.target == {"device": "h100", "batch_size": 256}
    assert p.target_device == "h100" and p.batch_size == 256
    assert p.locked == ["lm_head"]
    assert p.reasons == {"range_block": "fp16: overflow, max|y| 3.1e5 > 65504"}
    assert p.metrics == {"error": 0.021, "budget": 0.03, "est_speedup": 1.84, "feasible": True}
    assert p.provenance["trial"] == 17 and p.provenance["mlflow_run"] == "abc123"
    assert p.source.endswith("schema1_full.yaml")


def test_golden_minimal_file_with_a_target_name() -> None:
    p = load_policy(GOLDEN / "schema1_minimal.yaml")
    assert p.target == {"device": "l4"} and p.batch_size is None
    assert p.model == {} and p.fingerprint is None
    assert p.precisions == ("fp32", "bf16")


def test_target_mode_is_optional_and_round_trips(tmp_path: Path) -> None:
    assert load_policy(GOLDEN / "schema1_full.yaml").mode == "eager"  # old files: eager
    p = loads_policy("autoprec_policy: 1\ntarget: {device: cpu, batch_size: 8, mode: compile}"
                     "\ndefault: bf16\nlayers: {}\n")
    assert p.mode == "compile" and p.target == {"device": "cpu", "batch_size": 8,
                                                "mode": "compile"}
    p.save(tmp_path / "p.yaml")
    assert load_policy(tmp_path / "p.yaml").mode == "compile"
    assert "mode: compile" in (tmp_path / "p.yaml").read_text()


def test_round_trip(tmp_path: Path) -> None:
    p = load_policy(GOLDEN / "schema1_full.yaml")
    out = p.save(tmp_path / "sub" / "p.yaml")
    q = load_policy(out)
    assert q.to_dict() == p.to_dict()
    text = out.read_text()
    assert text.startswith("autoprec_policy: 1\nmodel:")  # schema order, version first
    assert "'0': fp16" in text  # a numeric-looking path stays a string
    assert q.source == str(out) == p.source


def test_policy_built_in_code_is_validated_and_normalised() -> None:
    p = Policy(default="bf16", layers={"module.enc.0": "fp16", 0: "fp32"},
               model={"name": "m", "fingerprint": None}, target="h100")  # type: ignore[arg-type]
    assert p.layers == {"enc.0": "fp16", "0": "fp32"}
    assert p.model == {"name": "m"} and p.target == {"device": "h100"}
    with pytest.raises(PolicyError, match=r"<policy>: layers\['a'\]: unknown precision 'int8'"):
        Policy(layers={"a": "int8"})
    assert SCHEMA_VERSION == 1


def test_atomic_save_keeps_the_old_file_on_failure(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"a": "bf16"}).save(path)
    old = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable for review, not 0600

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    # one line, exit 2 (OutputError is an InputError), the old file named as intact
    with pytest.raises(InputError, match="disk full; the previous file is unchanged"):
        Policy(default="fp16", layers={"a": "fp32"}).save(path)
    assert path.read_text() == old
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.yaml"]  # no temp file left


BASE = "autoprec_policy: 1\ndefault: fp32\nlayers: {a: bf16}\n"

BAD = {
    "unknown precision": (
        "autoprec_policy: 1\ndefault: fp32\nlayers:\n  enc.0.q: fp12\n",
        f"layers['enc.0.q']: unknown precision 'fp12'; {PRECS}"),
    "unknown schema version": (
        "autoprec_policy: 2\ndefault: fp32\nlayers: {}\n",
        "autoprec_policy: unknown schema version 2; this autoprec reads version 1"),
    "version as a string": (
        "autoprec_policy: '1'\ndefault: fp32\nlayers: {}\n",
        "autoprec_policy: must be the schema version (an integer), got a string '1'"),
    "missing version": ("default: fp32\nlayers: {}\n", "autoprec_policy: required key is missing"),
    "missing default": ("autoprec_policy: 1\nlayers: {}\n", "default: required key is missing"),
    "default wrong type": ("autoprec_policy: 1\ndefault: 16\nlayers: {}\n",
                           "default: must be a precision name"),
    "default fp8": ("autoprec_policy: 1\ndefault: fp8\nlayers: {}\n",
                    "default: fp8 cannot be the default"),
    "layers a list": ("autoprec_policy: 1\ndefault: fp32\nlayers: [a, b]\n",
                      "layers: must be a mapping, got a list"),
    "layer precision a list": ("autoprec_policy: 1\ndefault: fp32\nlayers: {a: [bf16]}\n",
                               "layers['a']: must be a precision name"),
    "layer path a float": ("autoprec_policy: 1\ndefault: fp32\nlayers: {1.10: bf16}\n",
                           "layers[1.1]: a module path must be a string"),
    "duplicate after normalising": (
        "autoprec_policy: 1\ndefault: fp32\nlayers: {a: bf16, module.a: fp16}\n",
        "layers['module.a']: duplicates layers['a'] once wrapper prefixes"),
    "unknown top-level key": (BASE + "layer: {b: fp16}\n", "layer: unknown key"),
    "target wrong type": (BASE + "target: [h100]\n", "target: must be a device name or a mapping"),
    "target batch size": (BASE + "target: {device: h100, batch_size: 0}\n",
                          "target.batch_size: must be a positive integer, got 0"),
    "target unknown key": (BASE + "target: {gpu: h100}\n", "target.gpu: unknown key"),
    "target mode": (BASE + "target: {device: cpu, mode: jit}\n",
                    "target.mode: must be one of eager, compile, got 'jit'"),
    "model fingerprint": (BASE + "model: {fingerprint: abc}\n",
                          "model.fingerprint: must look like 'sha256:<hex>'"),
    "model name type": (BASE + "model: {name: 3}\n", "model.name: must be a string"),
    "locked not a list": (BASE + "locked: a\n", "locked: must be a list of module paths"),
    "reason not a string": (BASE + "reasons: {a: 3}\n", "reasons['a']: must be a string"),
    "metric not a number": (BASE + "metrics: {error: high}\n",
                            "metrics.error: must be a number, got a string 'high'"),
    "feasible not a bool": (BASE + "metrics: {feasible: 'yes'}\n",
                            "metrics.feasible: must be true or false"),
    "provenance nested": (BASE + "provenance: {a: {b: {c: 1}}}\n",
                          "provenance.a: must be a scalar, list or mapping of scalars"),
    "top level a list": ("- 1\n- 2\n", "a policy must be a YAML mapping at the top level, "
                                       "got a list"),
    "empty file": ("", "a policy must be a YAML mapping at the top level, got empty"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_names_file_key_and_rule(tmp_path: Path, case: str) -> None:
    text, expected = BAD[case]
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value) == f"{path}: {expected}" or str(err.value).startswith(
        f"{path}: {expected}"), str(err.value)
    assert isinstance(err.value, InputError) and err.value.exit_code == 2


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("autoprec_policy: 1\ndefault: fp32\nlayers:\n  a: bf16\n   b: [fp16\n")
    with pytest.raises(PolicyError, match=rf"^{path}:5:\d+: not valid YAML: "):
        load_policy(path)


def test_only_safe_yaml(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text('!!python/object/apply:os.system ["echo pwned"]\n')
    with pytest.raises(PolicyError, match=rf"^{path}:1:1: not valid YAML: .*python/object.*no tags"):
        load_policy(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no such policy file"):
        load_policy(tmp_path / "nope.yaml")
    with pytest.raises(PolicyError, match="is a directory"):
        load_policy(tmp_path)


def test_loads_policy_from_text() -> None:
    p = loads_policy("autoprec_policy: 1\ndefault: fp16\nlayers:\n", source="inline")
    assert p.layers == {} and p.source == "inline"


def test_a_policy_without_layers_has_no_rules() -> None:
    """README: `default: bf16` with no rules runs like one global autocast; a file that
    leaves `layers` out says just that (it was refused: "layers: required key is missing")."""
    from autoprec.policy import loads_policy

    p = loads_policy("autoprec_policy: 1\ndefault: bf16\n")
    assert p.default == "bf16" and p.layers == {}
