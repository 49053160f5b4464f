"""Measured speed-up of the committed tuned policies on a GPU (issue 10).

For each ``policies/*.yaml`` (not ``examples/``) whose model is under ``experiments/``:
build the model on the GPU, enlarge its first calibration batch to the policy's
deployment batch size (repeating rows; capped by ``--max-batch``), and time with CUDA
events after warm-up (``autoprec.cost.measure_latency``):

- fp32 (tf32 off), the tuned policy (``apply_policy``; fp8 through the best backend the
  capability check finds), and one global ``torch.autocast(bfloat16)`` (uniform bf16);

then print the measured speed-ups next to the cost model's estimate recorded in the policy,
and write ``gpu_policies.csv`` / ``.md`` under ``--out`` (else $OUT, else ./gpu_policies_out).
Without CUDA it says why and exits 1; ``--dry-run`` runs on the CPU at the calibration
batch size to check the script (numbers meaningless there).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

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


def measure_policy(policy_path: Path, device: str, max_batch: int, dry_run: bool
                   ) -> dict[str, Any]:
    from autoprec.apply.apply import apply_policy
    from autoprec.cost.measure import measure_latency
    from autoprec.loading import load_model_file
    from autoprec.policy import load_policy

    pol = load_policy(policy_path)
    model_py = ROOT / "experiments" / str(pol.model_name) / "model.py"
    spec = load_model_file(model_py)
    net = spec.model().to(device)
    batch = to_device(spec.calibration_batches()[0], device)
    rows = 0 if dry_run else min(int(pol.batch_size or 0), max_batch)
    if rows:
        batch = enlarge(batch, rows)

    def run() -> Any:
        with torch.no_grad():
            return spec.forward(net, batch)

    if device == "cuda":  # fp32 means fp32: no tf32 behind our back
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    reps = 3 if dry_run else 20
    fp32 = measure_latency(run, device, warmup=2, repeats=reps).median_s
    with apply_policy(net, pol):
        tuned = measure_latency(run, device, warmup=2, repeats=reps).median_s

    def run_bf16() -> Any:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            return spec.forward(net, batch)

    bf16 = measure_latency(run_bf16, device, warmup=2, repeats=reps).median_s
    return {"policy": policy_path.name, "model": pol.model_name, "target": pol.target_device,
            "batch": rows or "calibration", "fp32_ms": fp32 * 1e3, "tuned_ms": tuned * 1e3,
            "bf16_ms": bf16 * 1e3, "tuned_speedup": fp32 / tuned,
            "bf16_speedup": fp32 / bf16, "est_speedup": pol.metrics.get("est_speedup")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, calibration batch size")
    ap.add_argument("--max-batch", type=int, default=4096, help="cap on rows per batch")
    ap.add_argument("--only", default="", help="comma list of policy file stems")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_policies: no CUDA device here; run on a GPU machine, or --dry-run",
              file=sys.stderr)
        return 1
    device = "cpu" if args.dry_run else "cuda"
    out = args.out or Path(os.environ.get("OUT") or "gpu_policies_out")
    out.mkdir(parents=True, exist_ok=True)
    wanted = {s for s in args.only.split(",") if s}
    rows = []
    for path in sorted((ROOT / "policies").glob("*.yaml")):
        if wanted and path.stem not in wanted:
            continue
        try:
            rows.append(measure_policy(path, device, args.max_batch, args.dry_run))
        except Exception as err:  # one model failing must not lose the others' figures
            rows.append({"policy": path.name, "error": f"{type(err).__name__}: {err}"[:200]})
        print(rows[-1], flush=True)
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame.to_csv(out / "gpu_policies.csv", index=False)
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in frame.iterrows():
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v)
                                       for v in r.tolist()) + " |")
    (out / "gpu_policies.md").write_text("\n".join(lines) + "\n")
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
