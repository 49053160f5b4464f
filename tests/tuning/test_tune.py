"""``tune`` end to end on the mixed-failure model (examples/trap/model.py).

No uniform low precision meets the 1% budget there (fp16 overflows in ``blow``, bf16 loses
``offset``'s signal); tune must find the mixed policy, and an evaluation that casts each
layer by hand — independent of autoprec's apply — must confirm it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autoprec.policy import load_policy
from autoprec.tuning.tune import tune
from autoprec.workload.loading import load_model_file
from tests.helpers import TRAP, run_cli

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def hand_forward(m: torch.nn.Module, x: torch.Tensor, assign: dict[str, str]) -> torch.Tensor:
    """The trap forward with each Linear computed as a tensor core does it: operands rounded
    to the layer's dtype, fp32 accumulation, output rounded to that dtype."""

    def lin(name: str, h: torch.Tensor) -> torch.Tensor:
        mod = getattr(m, name)
        p = assign.get(name, "fp32")
        if p == "fp32":
            return F.linear(h.float(), mod.weight, mod.bias)
        dt = LOW[p]
        y = F.linear(h.to(dt).float(), mod.weight.to(dt).float(), mod.bias.to(dt).float())
        return y.to(dt)

    h = torch.relu(lin("inp", x))
    h = m.norm1(lin("blow", h).float())
    h = F.gelu(lin("mid1", h).float())
    h = m.norm2(lin("offset", h).float())
    h = F.gelu(lin("mid2", h).float())
    return lin("head", h).float()


def hand_error(assign: dict[str, str]) -> float:
    spec = load_model_file(TRAP)
    m = spec.model()
    num = den = 0.0
    with torch.no_grad():
        for x in spec.eval_batches():
            ref = m(x)
            y = hand_forward(m, x, assign)
            if not torch.isfinite(y).all():
                return math.inf
            num += float(((y - ref) ** 2).sum())
            den += float((ref**2).sum())
    return math.sqrt(num / den)


def test_no_uniform_precision_meets_the_budget():
    layers = ["inp", "blow", "mid1", "offset", "mid2", "head"]
    assert hand_error({k: "fp16" for k in layers}) == math.inf  # blow overflows
    assert hand_error({k: "bf16" for k in layers}) > 0.02  # offset's signal is lost


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tune") / "trap.yaml"
    result = tune(TRAP, max_error=0.01, precisions=["bf16", "fp16"], batch_size=65536,
                  trials=8, seed=0, out=out, progress=False)
    return result


def _effective(policy) -> dict[str, str]:
    """The precision every Linear of trap computes in under the policy (its plan)."""
    from autoprec.plan import resolve_path

    m = load_model_file(TRAP).model()
    return {n: resolve_path(policy, n, mod).precision for n, mod in m.named_children()
            if isinstance(mod, torch.nn.Linear)}


def test_tune_finds_a_mixed_policy_that_hand_casting_confirms(tuned):
    assert tuned.feasible
    policy = load_policy(tuned.path)
    assign = _effective(policy)
    assert assign.get("blow", "fp32") != "fp16"  # would overflow
    assert assign.get("offset", "fp32") != "bf16"  # would lose the signal
    assert {"bf16", "fp16"} <= set(assign.values())  # really mixed
    assert tuned.est_speedup > 1.5
    err = hand_error(assign)
    assert err <= 0.01
    # autoprec's own measurement agrees with the hand computation
    assert policy.metrics["error"] == pytest.approx(err, rel=0.25)
    assert "65504" in policy.reasons["blow"]
    # the winner's headroom (evaluation.headroom): the least, and the layer it is at
    low = policy.metrics["min_headroom_layer"]
    assert policy.metrics["min_headroom"] > 1 and assign[low] in ("bf16", "fp16")
    assert policy.provenance["seed"] == 0 and policy.model["fingerprint"].startswith("sha256:")
    assert policy.target == {"device": "h100", "batch_size": 65536}


def test_same_seed_gives_the_same_policy(tuned, tmp_path: Path):
    again = tune(TRAP, max_error=0.01, precisions=["bf16", "fp16"], batch_size=65536,
                 trials=8, seed=0, out=tmp_path / "again.yaml", progress=False)
    assert again.policy.layers == tuned.policy.layers


def test_resume_runs_no_finished_trial_again(tmp_path: Path):
    """One trial, then --resume: the walk goes on from the stored trials (the sampler reads
    them from storage) and stops when nothing faster is predicted within budget; a third
    run finds the search complete and measures nothing."""
    out = tmp_path / "r.yaml"
    kw = dict(max_error=0.01, precisions=["bf16", "fp16"], batch_size=65536, out=out,
              progress=False, study_name="r")
    first = tune(TRAP, trials=1, **kw)
    assert first.search.trials == 1 and not first.search.complete
    second = tune(TRAP, trials=40, resume=True, **kw)
    assert second.search.complete and second.feasible
    third = tune(TRAP, trials=40, resume=True, **kw)
    assert third.search.complete and third.search.trials == 0 and third.search.evaluations == 0
    assert third.policy.layers == second.policy.layers
    import optuna

    study = optuna.load_study(study_name="r", storage=f"sqlite:///{tmp_path / 'studies' / 'trap.db'}")
    measured = [t for t in study.trials if "error" in t.user_attrs]
    keys = [tuple(sorted(t.params.items())) for t in measured]
    assert len(keys) == len(set(keys))  # no plan measured twice


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code, _, err = run_cli(args, capsys)
    return code, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-error", "-0.1"], "--max-error: must be >= 0"),
        (["--max-error", "nan"], "--max-error: must be a finite number"),
        (["--max-error", "abc"], "max-error"),
        (["--target", "v100"], "v100"),
        (["--precisions", "fp16,fp12"], "unknown precision 'fp12'"),
        (["--trials", "0"], "--trials: must be >= 1"),
        (["--precisions", ""], "--precisions: give at least one"),
        (["--precisions", "fp8", "--target", "t4"], "the target t4 runs none of them"),
        (["--lock", "nope"], "--lock 'nope'"),
        (["--study-name", ""], "--study-name: must not be empty"),
        (["--workers", "0"], "--workers: must be >= 1"),
        (["--patience", "0"], "--patience: must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys, tmp_path: Path):
    code, err = _cli(["tune", str(TRAP), "--no-track", "--quiet", "--out",
                      str(tmp_path / "p.yaml"), *args], capsys)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.yaml").exists()


def test_a_study_of_another_model_is_refused(tmp_path: Path, capsys):
    other = tmp_path / "other.py"
    other.write_text(
        "import torch\n"
        "def build_model():\n    torch.manual_seed(0)\n    return torch.nn.Sequential(torch.nn.Linear(64, 32))\n"
        "def calibration_data():\n    return [torch.randn(4, 64)]\n")
    db = f"sqlite:///{tmp_path / 's.db'}"
    common = ["--no-track", "--storage", db, "--study-name", "shared", "--trials", "1",
              "--quiet", "--precisions", "fp16"]
    code, err = _cli(["tune", str(other), "--out", str(tmp_path / "a.yaml"), *common], capsys)
    assert code == 0, err
    code, err = _cli(["tune", str(TRAP), "--out", str(tmp_path / "b.yaml"), *common], capsys)
    assert code == 2 and "fingerprint" in err and len(err.strip().splitlines()) == 1, err


def test_out_that_cannot_be_written_is_refused_before_the_search(tmp_path: Path, capsys):
    code, err = _cli(["tune", str(TRAP), "--no-track", "--out", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in err and len(err.strip().splitlines()) == 1


def test_a_study_tuned_with_other_settings_is_refused(tmp_path: Path, capsys):
    db = f"sqlite:///{tmp_path / 's.db'}"
    common = ["tune", str(TRAP), "--no-track", "--quiet", "--storage", db, "--study-name",
              "s", "--trials", "1", "--precisions", "fp16", "--out", str(tmp_path / "p.yaml")]
    code, err = _cli([*common, "--batch-size", "65536"], capsys)
    assert code == 0, err
    code, err = _cli([*common, "--batch-size", "1024"], capsys)
    assert code == 2 and "other settings (batch_size: 65536 there, 1024 now)" in err, err


def test_compile_mode_prices_compiled_and_is_recorded(tmp_path: Path, capsys):
    db = f"sqlite:///{tmp_path / 's.db'}"
    common = ["tune", str(TRAP), "--no-track", "--quiet", "--storage", db, "--study-name",
              "s", "--trials", "2", "--precisions", "fp16", "--target", "t4",
              "--out", str(tmp_path / "p.yaml")]
    code, err = _cli([*common, "--compile"], capsys)
    assert code == 0, err
    pol = load_policy(tmp_path / "p.yaml")
    assert pol.mode == "compile" and pol.target["device"] == "t4"
    # the compiled price is a study setting: an eager run may not join the compiled study
    code, err = _cli(common, capsys)
    assert code == 2 and "other settings (mode: 'compile' there, None now)" in err, err
