"""A plan that a one-line default says is written as that line; when a one-liner is
estimated as fast but is another plan, tune says which modules it would change."""

from __future__ import annotations

from pathlib import Path

from autoprec.policy import load_policy
from tests.helpers import MODELS, TRAP
from tests.helpers import run_cli as run

ENCODER = MODELS / "encoder4.py"
TUNE = ["--no-track", "--quiet", "--trials", "2", "--target", "h100"]


def test_tf32_on_every_layer_but_the_head_is_written_as_the_tf32_default(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """trap on an h100 at 4096 rows: tf32 everywhere but the 256 -> 16 head; it was written
    `default: fp32` + 5 tf32 rules."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["tune", TRAP, *TUNE, "--batch-size", "4096", "--out", "p.yaml"],
                         capsys)
    assert code == 0, err
    policy = load_policy(tmp_path / "p.yaml")
    assert (policy.default, policy.layers) == ("tf32", {"head": "fp32"}), policy.layers


def test_a_one_liner_as_fast_but_another_plan_is_named_with_the_difference(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """The 4-block encoder in the train form (autocast: a 16-bit layer re-casts its weight
    per call, so tf32 wins at this batch): tf32 on its 16 Linear layers, its attention
    (SDPA) kept fp32 — the tf32 flag is priced the same, and would also run the attention
    in tf32. (In the deploy form the same tune writes `default: fp16`, a one-liner.)"""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["tune", ENCODER, *TUNE, "--batch-size", "256", "--form", "train",
                          "--out", "p.yaml"], capsys)
    assert code == 0, err
    policy = load_policy(tmp_path / "p.yaml")
    assert policy.layers and policy.default == "tf32"
    note = next(line for line in err.splitlines() if "one line `default: tf32`" in line)
    assert "is not the same plan" in note and "blocks.0.attn (fp32 here)" in note, note
    assert note.endswith("in tf32"), note
