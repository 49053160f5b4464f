"""``autoprec show`` and ``autoprec eval``: tables, --json, and exit codes (2: bad file)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from autoprec.policy import Policy
from autoprec.trace.graph import fingerprint
from tests.helpers import ROOT
from tests.helpers import run_cli as run

GOLDEN = ROOT / "tests" / "policy" / "golden"

MODEL_PY = '''
import torch
from torch import nn
import torch.nn.functional as F


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 16)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):  # forced fp32, as MoE routers do
            return F.linear(x.float(), self.gate.weight, self.gate.bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.ln = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 64)
        self.router = Router()
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = self.fc2(self.ln(torch.relu(self.fc1(x))))
        return self.head(h) + self.router(h).sum(-1, keepdim=True)


def build_model():
    torch.manual_seed(0)
    return Net()


def calibration_data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 32, generator=g) for _ in range(2)]
'''

METRIC = '''

def metric(outputs, batch):
    return float((outputs.argmax(-1) == 0).float().mean())
'''


@pytest.fixture()
def model_py(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL_PY)
    return path


def _fp(model_py: Path) -> str:
    from autoprec.workload.loading import load_model_file

    return fingerprint(load_model_file(model_py).model())


# -- show ---------------------------------------------------------------------------------

def test_show_prints_rules_reasons_metrics_provenance(capsys) -> None:
    code, out, err = run(["show", str(GOLDEN / "schema1_full.yaml")], capsys)
    assert code == 0, err
    assert "model: trap" in out and "target: h100, batch size 256" in out
    assert "default: fp32" in out
    lines = out.splitlines()
    assert any(line.split()[:2] == ["encoder.layer.0.attention.self.query", "fp8"]
               for line in lines)
    assert any(line.startswith("lm_head") and "yes" in line for line in lines)  # locked
    assert "fp16: overflow, max|y| 3.1e5 > 65504" in out
    assert "est_speedup 1.84" in out and "trial 17" in out


@pytest.mark.parametrize("text, key", [
    ("autoprec_policy: 1\ndefault: fp32\nlayers: {enc.0.q: fp12}\n",
     "layers['enc.0.q']: unknown precision 'fp12'; expected one of fp32, tf32, bf16, fp16, "
     "fp8"),
    ("autoprec_policy: 1\ndefault: fp32\nlayers:\n  a: bf16\n b: [\n", ":5:"),
    ("autoprec_policy: 7\ndefault: fp32\nlayers: {}\n", "autoprec_policy: unknown schema "
                                                        "version 7"),
    ("autoprec_policy: 1\ndefault: fp32\nlayers: {a: bf16}\ntarget: {batch_size: -1}\n",
     "target.batch_size: must be a positive integer"),
])
def test_show_bad_file_exit_2_one_line(tmp_path: Path, capsys, text: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = run(["show", str(path)], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith(f"autoprec: error: {path}") and key in err
    assert len(err.strip().splitlines()) == 1


# -- eval ---------------------------------------------------------------------------------

def test_eval_json_summary(tmp_path: Path, model_py: Path, capsys) -> None:
    pol = tmp_path / "p.yaml"
    Policy(layers={"fc1": "bf16", "fc2": "fp8", "ln": "bf16"},
           model={"name": "net", "fingerprint": _fp(model_py)},
           target={"device": "h100", "batch_size": 64},
           reasons={"head": "fp8: out_features 10 not a multiple of 16"},
           metrics={"error": 0.01, "budget": 0.5}).save(pol)
    code, out, err = run(["eval", str(model_py), "--policy", str(pol), "--json"], capsys)
    assert code == 0, err
    s = json.loads(out)
    for key in ("error", "budget", "est_speedup", "feasible", "target", "batch_size",
                "reasons", "layers"):
        assert key in s, key
    assert 0 < s["error"] < 0.5 and s["budget"] == 0.5 and s["feasible"] is True
    assert s["target"] == "h100" and s["batch_size"] == 64 and s["est_speedup"] > 0
    assert s["fp8_backend"] == "emulated"
    rows = {r["layer"]: r for r in s["layers"]}
    assert (rows["fc1"]["precision"], rows["fc1"]["computed"]) == ("bf16", "bf16")
    assert (rows["fc2"]["precision"], rows["fc2"]["computed"]) == ("fp8", "fp8")
    assert rows["head"]["rule"] == "<default>" and rows["head"]["computed"] == "fp32"
    assert "metric_drop" not in s
    # the norm-only rule is a warning, on stderr and in the summary
    assert "layers['ln']: bf16 rule covers no autocast-eligible op" in err
    assert any("layers['ln']" in w for w in s["warnings"])
    assert s["mode"] == "eager"
    code, out, err = run(["eval", str(model_py), "--policy", str(pol), "--json", "--compile"],
                         capsys)
    assert code == 0, err
    c = json.loads(out)
    assert c["mode"] == "compile" and c["error"] == s["error"]  # apply is unchanged
    assert c["breakdown"]["kernels"] < s["breakdown"]["kernels"]


def test_eval_table_target_override_and_metric_drop(tmp_path: Path, model_py: Path,
                                                    capsys) -> None:
    model_py.write_text(MODEL_PY + METRIC)
    pol = tmp_path / "p.yaml"
    Policy(default="fp32", layers={"fc1": "fp16"}).save(pol)
    code, out, err = run(["eval", str(model_py), "--policy", str(pol), "--target", "l4",
                          "--batch-size", "8"], capsys)
    assert code == 0, err
    assert "fingerprint: missing" in err  # hand-written: warned, not refused
    assert "metric drop" in out and "on l4 at batch size 8" in out
    assert any(line.split()[:4] == ["fc1", "fc1", "fp16", "fp16"] for line in out.splitlines())
    code, out, _ = run(["eval", str(model_py), "--policy", str(pol), "--json"], capsys)
    s = json.loads(out)
    assert "metric_drop" in s and s["target"] == "h100" and s["batch_size"] == 4


def test_eval_fingerprint_mismatch_exit_2_unless_forced(tmp_path: Path, model_py: Path,
                                                        capsys) -> None:
    pol = tmp_path / "p.yaml"
    Policy(layers={"fc1": "bf16"}, model={"fingerprint": "sha256:" + "0" * 64}).save(pol)
    code, out, err = run(["eval", str(model_py), "--policy", str(pol)], capsys)
    assert code == 2 and out == ""
    assert f"autoprec: error: {pol}: model.fingerprint: sha256:0000" in err
    assert "--force" in err
    code, out, err = run(["eval", str(model_py), "--policy", str(pol), "--force", "--json"],
                         capsys)
    assert code == 0 and "applied anyway (forced)" in err
    assert json.loads(out)["layers"]


@pytest.mark.parametrize("layers, key", [
    ({"fc9": "bf16"}, "layers['fc9']: the model has no module 'fc9' (did you mean 'fc"),
    ({"head": "fp8"}, "layers['head']: fp8 rule on an ineligible layer: fp8: out_features 10"),
])
def test_eval_bad_policy_for_the_model_exit_2(tmp_path: Path, model_py: Path, capsys,
                                              layers: dict[str, str], key: str) -> None:
    pol = tmp_path / "p.yaml"
    Policy(layers=layers).save(pol)
    code, out, err = run(["eval", str(model_py), "--policy", str(pol), "--json"], capsys)
    assert code == 2 and out == ""
    assert f"autoprec: error: {pol}: {key}" in err


def test_eval_audit_failure_exit_1(tmp_path: Path, model_py: Path, capsys) -> None:
    pol = tmp_path / "p.yaml"
    Policy(layers={"router": "bf16"}).save(pol)
    code, out, err = run(["eval", str(model_py), "--policy", str(pol), "--json"], capsys)
    assert code == 1
    rows = {r["layer"]: r for r in json.loads(out)["layers"]}
    assert (rows["router"]["precision"], rows["router"]["computed"]) == ("bf16", "fp32")
    assert "layer 'router': rule router says bf16, but its GEMMs computed in fp32" in err


def test_eval_unknown_target_exit_2(tmp_path: Path, model_py: Path, capsys) -> None:
    pol = tmp_path / "p.yaml"
    pol.write_text(textwrap.dedent("""\
        autoprec_policy: 1
        default: fp32
        layers: {fc1: bf16}
    """))
    code, _, err = run(["eval", str(model_py), "--policy", str(pol), "--target", "h999"],
                       capsys)
    assert code == 2 and "unknown target device 'h999'" in err
