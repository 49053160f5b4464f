"""Deploying a policy needs torch, not the tuner's stack: ``import autoprec``,
``load_policy`` and ``apply_policy`` (with a forward under the policy and its audit), and
naming ``autoprec.tune`` / ``check`` / ``evaluate``, must not
import optuna, mlflow, pandas, matplotlib or scipy. Run in a fresh interpreter, since this
test process has imported all of them already."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import ROOT

HEAVY = ("optuna", "mlflow", "pandas", "matplotlib", "scipy", "sqlalchemy", "transformers")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import autoprec
    from autoprec import apply_policy, load_policy
    # the Python API's entry points load the tuner's stack when called, not when named
    autoprec.tune, autoprec.check, autoprec.evaluate, autoprec.ApplyOptions

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 32)
            self.b = torch.nn.Linear(32, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = Net()
    path = sys.argv[1]
    open(path, "w").write("autoprec_policy: 1\\ndefault: fp32\\nlayers: {a: bf16, b: fp16}\\n")
    policy = load_policy(path, model=model)
    x = torch.randn(4, 16)
    with apply_policy(model, policy) as handle:
        y = model(x)
        report = handle.audit(lambda: model(x))
    assert y.shape == (4, 8) and report.ok, report
    handle = apply_policy(model, policy)
    model(x)
    handle.remove()
    print(json.dumps(sorted(m.split(".")[0] for m in sys.modules)))
    """
)


def test_load_and_apply_import_none_of_the_tuners_stack(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SCRIPT, str(tmp_path / "p.yaml")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "autoprec" in loaded and "torch" in loaded
    assert not loaded & set(HEAVY), f"imported: {sorted(loaded & set(HEAVY))}"
