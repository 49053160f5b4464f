"""Measured speed-up of the committed tuned policies on a GPU, against one global autocast.

For each ``policies/*.yaml`` (not ``examples/``) whose model is under ``examples/``:
build the model on the GPU, enlarge its first calibration batch to the policy's
deployment batch size (``target.batch_size``; repeating rows, capped by ``--max-batch``),
and time with CUDA events after warm-up (``autoprec.cost.measure_latency``):

- fp32 (tf32 off): the reference of every speed-up;
- the policy, installed with ``apply_policy(..., target=<the policy's target>)``: its
  ``default`` is the region of the model's own code, its rules are exceptions; fp8 through
  the best backend the capability check finds (the audit of one real forward says whether
  every GEMM computed in its planned precision);
- one global ``torch.autocast`` in bf16 and in fp16 (what a user would write instead);

then print the measured speed-ups, the ratio policy / global autocast, and the cost
model's estimates of the same three plans on ``--profile`` (default h200, the lent GPU) at
the measured batch size — plus the estimate recorded in the policy file (for its own
target) — and write ``gpu_policies.csv`` / ``.md`` under ``--out`` (else $OUT, else
./gpu_policies_out). Only speed is measured here, not the error: which global autocast
meets the policy's budget is ``benchmarks/run_all.py``'s question.

Without CUDA it says why and exits 1; ``--dry-run`` runs on the CPU at the calibration
batch size to check the script (numbers meaningless there).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import example

ROOT = Path(__file__).resolve().parents[1]


def to_device(batch: Any, device: str) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def enlarge(batch: Any, rows: int) -> Any:
    """Repeat the batch's leading dimension up to ``rows`` (sequences/images, not tokens)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] >= rows:
            return batch
        reps = -(-rows // batch.shape[0])
        return batch.repeat(reps, *([1] * (batch.dim() - 1)))[:rows]
    if isinstance(batch, dict):
        return {k: enlarge(v, rows) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(enlarge(v, rows) for v in batch)
    return batch


def measure_policy(policy_path: Path, device: str, max_batch: int, dry_run: bool,
                   profile_name: str = "h200") -> dict[str, Any]:
    from autoprec.apply.apply import apply_policy
    from autoprec.cost import CostModel, get_profile
    from autoprec.device.capability import capability
    from autoprec.measure import measure_latency
    from autoprec.policy import Policy, load_policy
    from autoprec.trace import trace
    from autoprec.workload.loading import load_model_file
    from autoprec.workload.metrics import batch_size_of

    pol = load_policy(policy_path)
    model_py = example(str(pol.model_name))
    spec = load_model_file(model_py)
    net = spec.model().to(device)
    calib = to_device(spec.calibration_batches()[0], device)
    rows = 0 if dry_run else min(int(pol.batch_size or 0), max_batch)
    batch = enlarge(calib, rows) if rows else calib

    def run() -> Any:
        with torch.no_grad():
            return spec.forward(net, batch)

    if device == "cuda":  # fp32 means fp32: no tf32 behind our back
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    reps = 3 if dry_run else 20
    target = pol.target_device or device
    out: dict[str, Any] = {"policy": policy_path.name, "model": pol.model_name,
                           "target": target, "default": pol.default, "rules": len(pol.layers),
                           "batch": batch_size_of(batch)}
    fp32 = measure_latency(run, device, warmup=2, repeats=reps).median_s
    with apply_policy(net, pol, target=target) as handle:
        report = handle.audit(run, strict=False)
        out["audit"] = "ok" if report.ok else "MISMATCH: " + "; ".join(report.errors)[:160]
        out["fp8_backend"] = handle.fp8_backend or ""
        tuned = measure_latency(run, device, warmup=2, repeats=reps).median_s
    out.update(fp32_ms=fp32 * 1e3, tuned_ms=tuned * 1e3, tuned_speedup=fp32 / tuned)

    # the cost model's view of the same plans, on the machine measured here
    with torch.no_grad():
        graph = trace(net, calib, forward=spec.forward, tracers=("hooks",))
    cost = CostModel(graph, get_profile(profile_name), batch_size=out["batch"])
    out["est_tuned_speedup"] = cost.speedup(pol)
    bd = cost.breakdown(pol)
    out["casts"] = bd.casts + bd.weight_casts
    for prec, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        ok, why = capability(prec, device=device)
        if not ok:
            out[f"autocast_{prec}_ms"] = math.nan
            out[f"note_{prec}"] = why
            continue

        def run_global(dtype: torch.dtype = dtype) -> Any:
            with torch.no_grad(), torch.autocast(device, dtype=dtype):
                return spec.forward(net, batch)

        t = measure_latency(run_global, device, warmup=2, repeats=reps).median_s
        out[f"autocast_{prec}_ms"] = t * 1e3
        out[f"{prec}_speedup"] = fp32 / t
        out[f"tuned_over_{prec}"] = tuned / t  # <= 1: the policy is at least as fast
        out[f"est_{prec}_speedup"] = cost.speedup(Policy(default=prec))
    out["recorded_est_speedup"] = pol.metrics.get("est_speedup")
    return out


def _markdown(frame) -> str:  # noqa: ANN001 - a pandas DataFrame
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in frame.iterrows():
        lines.append("| " + " | ".join("" if isinstance(v, float) and math.isnan(v)
                                       else f"{v:.3g}" if isinstance(v, float) else str(v)
                                       for v in r.tolist()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, calibration batch size")
    ap.add_argument("--max-batch", type=int, default=4096, help="cap on rows per batch")
    ap.add_argument("--only", default="", help="comma list of policy file stems")
    ap.add_argument("--profile", default="h200",
                    help="device profile for the estimates (the GPU measured here)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_policies: no CUDA device here; run on a GPU machine, or --dry-run",
              file=sys.stderr)
        return 1
    device = "cpu" if args.dry_run else "cuda"
    out = args.out or Path(os.environ.get("OUT") or "gpu_policies_out")  # CLI boundary
    out.mkdir(parents=True, exist_ok=True)
    wanted = {s for s in args.only.split(",") if s}
    from autoprec.policy import PolicyWarning

    warnings.simplefilter("ignore", PolicyWarning)
    paths = [p for p in sorted((ROOT / "policies").glob("*.yaml"))
             if not wanted or p.stem in wanted]
    missing = wanted - {p.stem for p in paths}
    if missing:
        print(f"gpu_policies: --only {','.join(sorted(missing))}: no such policy under "
              f"{ROOT / 'policies'}", file=sys.stderr)
        return 2
    rows = []
    for path in paths:
        try:
            rows.append(measure_policy(path, device, args.max_batch, args.dry_run,
                                       args.profile))
        except Exception as err:  # one model failing must not lose the others' figures
            rows.append({"policy": path.name, "error": f"{type(err).__name__}: {err}"[:200]})
        print(rows[-1], flush=True)
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame.to_csv(out / "gpu_policies.csv", index=False)
    where = (torch.cuda.get_device_name() if device == "cuda"
             else "cpu (DRY RUN: calibration batch, numbers meaningless)")
    head = [f"# committed policies on {where}", "",
            f"Speed-ups over fp32 measured with {'CUDA events' if device == 'cuda' else 'wall time'}"
            f"; est_*: the cost model on the {args.profile} profile at the measured batch; "
            "recorded_est_speedup: the figure in the policy file (its own target); "
            "tuned_over_*: policy time / one global autocast's (<= 1: the policy is at "
            "least as fast).", ""]
    (out / "gpu_policies.md").write_text("\n".join(head) + _markdown(frame) + "\n")
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
