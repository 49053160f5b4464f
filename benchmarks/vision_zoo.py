"""torchvision and timm models through the whole flow: tune, apply, audit in every mode.

For each model (small configs built offline, random init, real images: scikit-learn's
digits upsampled to 32x32 as in examples/vit): ``autoprec.tune`` at a 1 % budget for an
H100 at batch 256, then the written policy applied and checked under ``no_grad``,
``torch.inference_mode``, grad enabled and ``torch.compile`` — the eager audit, the audit
of the compiled graph (``PolicyHandle.audit_compiled``) and the error against fp32 in each
mode (inductor for the compiled one). torchvision's ``VisionTransformer`` uses
``nn.MultiheadAttention`` (the fused-path case of autoprec/fused.py); timm's ViT its own
qkv Linear + SDPA; ResNet and ConvNeXt are conv nets.

torchvision 0.29 needs torch 2.14, so this runs in its own venv beside the CPU pin:

    python3 -m venv /tmp/v214 && /tmp/v214/bin/pip install torch==2.14.1 torchvision==0.29.1 timm
    /tmp/v214/bin/pip install -e '.[dev]' && /tmp/v214/bin/python -m benchmarks.vision_zoo
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoprec
from autoprec.fused import fused_paths_off
from autoprec.workload.loading import ModelSpec

BATCH = 8


@functools.lru_cache(maxsize=1)
def _images() -> torch.Tensor:
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return (x.repeat(1, 3, 1, 1) - 0.5) / 0.5  # (N, 3, 32, 32)


def _batches(start: int, n: int) -> list[torch.Tensor]:
    x = _images()
    return [x[start + i * BATCH:start + (i + 1) * BATCH] for i in range(n)]


def tv_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    m = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                          hidden_dim=64, mlp_dim=128, num_classes=10)
    nn.init.normal_(m.heads.head.weight, std=0.02)  # torchvision zero-initialises the head
    return m


def tv_resnet18() -> nn.Module:
    from torchvision.models import resnet18

    return resnet18(num_classes=10)


def timm_vit() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, num_classes=10)


def timm_convnext() -> nn.Module:
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


MODELS = {"torchvision ViT": tv_vit, "torchvision ResNet-18": tv_resnet18,
          "timm ViT-Tiny": timm_vit, "timm ConvNeXt-Atto": timm_convnext}


def _spec(name: str, build: Any) -> ModelSpec:
    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return build().float().eval()

    return ModelSpec(path=Path(__file__), name=name.replace(" ", "_").lower(),
                     build_model=build_model, calibration_data=lambda: _batches(0, 2),
                     eval_data=lambda: _batches(64, 4))


def _error(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """Relative L2 over the whole eval set (as tune records it)."""
    err = ref_sq = 0.0
    for out, ref in zip(outs, refs):
        out, ref = out.detach().float(), ref.float()
        if not bool(torch.isfinite(out).all()):
            return math.inf
        err, ref_sq = err + float((out - ref).pow(2).sum()), ref_sq + float(ref.pow(2).sum())
    return math.sqrt(err / ref_sq)


def run(name: str, build: Any, budget: float, trials: int, tmp: Path) -> dict[str, Any]:
    spec = _spec(name, build)
    t0 = time.perf_counter()
    res = autoprec.tune(spec, max_error=budget, target="h100", batch_size=256, trials=trials,
                        out=tmp / f"{spec.name}.yaml", progress=False,
                        cache_dir=tmp / "cache")
    tune_s = time.perf_counter() - t0
    model = spec.model()
    policy = autoprec.load_policy(res.path, model=model)
    xs = spec.eval_batches()
    x = xs[0]
    with torch.no_grad(), fused_paths_off():
        ref = [model(b) for b in xs]
    errors, audits = {}, {}
    with autoprec.apply_policy(model, policy) as h:
        with torch.no_grad():
            audits["eager"] = h.audit(lambda: model(x), strict=False).ok
            errors["no_grad"] = _error([model(b) for b in xs], ref)
        with torch.inference_mode():
            errors["inference_mode"] = _error([model(b) for b in xs], ref)
        errors["grad"] = _error([model(b) for b in xs], ref)
        torch._dynamo.reset()
        with torch.no_grad():
            rep = h.audit_compiled(lambda m: m(x), strict=False)
            audits["compiled graph"] = rep.ok
            if not rep.ok:
                print(f"  {name}: {rep.errors[0]}", flush=True)
            fast = torch.compile(model)
            errors["compiled (inductor)"] = _error([fast(b) for b in xs], ref)
    return {"model": name, "policy": f"default {policy.default}, {len(policy.layers)} rules",
            "est_speedup": res.est_speedup, "tune_s": tune_s, "errors": errors,
            "audits": audits, "recorded": float(policy.metrics.get("error", math.nan))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--only", default=None, help="one model name")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}; tune at {args.budget:g}, target h100, batch 256; "
          f"errors on the 4 eval batches of {BATCH} images against fp32")
    print("| model | policy | est. speed-up | tune's error | no_grad | inference_mode | grad "
          "| compiled (inductor) | audit eager / compiled graph | tune s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name, build in MODELS.items():
            if args.only and args.only != name:
                continue
            r = run(name, build, args.budget, args.trials, Path(d))
            e = r["errors"]
            audit = " / ".join("clean" if ok else "FAILED" for ok in r["audits"].values())
            print(f"| {r['model']} | {r['policy']} | {r['est_speedup']:.2f}x "
                  f"| {r['recorded']:.4g} | {e['no_grad']:.4g} | {e['inference_mode']:.4g} "
                  f"| {e['grad']:.4g} | {e['compiled (inductor)']:.4g} | {audit} "
                  f"| {r['tune_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
