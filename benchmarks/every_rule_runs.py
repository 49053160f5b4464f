"""The issue's table on torch.nn's own transformer blocks, measured: does every rule run?

``examples/nn_transformer/model.py`` (3 x nn.TransformerEncoderLayer, d=192) under
  A. ``default: fp32`` + fp8 on every linear1/linear2 (the FFN), and
  B. ``default: bf16`` + ``encoder.layers: fp16``;
prints each policy's error against fp32 on the eval data under ``no_grad``,
``torch.inference_mode``, grad enabled and ``torch.compile`` (inductor), the eager and
compiled audits, and ``check --max-error 0.01``'s verdict. Before autoprec turned torch.nn's
fused paths off under a policy, A measured 2.9e-7 under no_grad (no rule ran) and check
passed it; B compiled measured 2.5e-7 (the policy dropped).

    .venv/bin/python -m benchmarks.every_rule_runs --out benchmarks/results
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch

from autoprec import apply_policy
from autoprec.evaluation.check import check
from autoprec.fused import fused_paths_off
from autoprec.policy import Policy
from autoprec.workload.loading import load_model_file
from benchmarks.common import example

MODEL = example("nn_transformer")
POLICIES = {
    "A: fp32 + fp8 FFN": Policy(default="fp32", layers={
        f"encoder.layers.{i}.linear{j}": "fp8" for i in range(3) for j in (1, 2)}),
    "B: bf16 + fp16 blocks": Policy(default="bf16", layers={"encoder.layers": "fp16"}),
}


def _error(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    num = sum(float((o.detach().float() - r).pow(2).sum()) for o, r in zip(outs, refs))
    den = sum(float(r.pow(2).sum()) for r in refs)
    return math.sqrt(num / den)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for every_rule_runs.md")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    spec = load_model_file(MODEL)
    net, xs = spec.model(), spec.eval_batches()
    with torch.no_grad(), fused_paths_off():
        ref = [net(x) for x in xs]
    lines = [f"torch {torch.__version__}; {MODEL.parent.name}, {len(xs)} eval batches; "
             "error = relative L2 against fp32",
             "",
             "| policy | no_grad | inference_mode | grad | compiled (inductor) | audit eager / "
             "compiled graph | check --max-error 0.01 |",
             "|---|---|---|---|---|---|---|"]
    for name, pol in POLICIES.items():
        torch._dynamo.reset()
        with apply_policy(net, pol) as h:
            with torch.no_grad():
                e_ng = _error([net(x) for x in xs], ref)
                eager = h.audit(lambda: net(xs[0]), strict=False).ok
                compiled = h.audit_compiled(lambda m: m(xs[0]), strict=False).ok
                fast = torch.compile(net)
                e_c = _error([fast(x) for x in xs], ref)
            with torch.inference_mode():
                e_inf = _error([net(x) for x in xs], ref)
            e_g = _error([net(x) for x in xs], ref)
        verdict = check(MODEL, pol, max_error=0.01)
        gate = "PASSED" if verdict.passed else f"FAILED ({verdict.error:.4g})"
        audits = " / ".join("clean" if ok else "FAILED" for ok in (eager, compiled))
        lines.append(f"| {name} | {e_ng:.4g} | {e_inf:.4g} | {e_g:.4g} | {e_c:.4g} | {audits} "
                     f"| {gate} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "every_rule_runs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
