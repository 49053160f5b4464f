"""A ViT-style image encoder on real images (handwritten digits, upsampled), random weights.

Model: HF ``ViTForImageClassification`` from a ``ViTConfig`` — image 32x32, 3 channels,
patch 4 (64 patches + CLS = 65 tokens), hidden 256, 4 layers, 4 heads, MLP 1024, a 10-way
head. RANDOM INIT (seed 0): no ViT weights can be fetched here; the shapes are what matter
to the cost model (patch-embedding conv, 16-aligned attention/MLP GEMMs, an ineligible
10-way head).

Data: scikit-learn's ``load_digits`` (real 8x8 images), bilinearly upsampled to 32x32 and
repeated over 3 channels, normalised to mean 0.5 / std 0.5 as HF's ViT image processor does.
Calibration = images 0-31, eval = images 32-95, in batches of 16 (``(pixels, labels)``):
at 65 tokens an image a batch is ~6.8 GFLOP, so calibration stays ~0.3 s in fp32 on a core.

Outputs: logits ``(B, 10)``, scored by autoprec's default relative L2 error (no ``metric``:
a random model's accuracy is chance). Loss: cross-entropy against the digit labels, for
gradient probes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "vit"
IMAGE, BATCH = 32, 16
CALIBRATION = range(0, 32)
EVAL = range(32, 96)


def build_model() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMAGE,
        patch_size=4,
        num_channels=3,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,  # head dim 64, as in ViT-B
        intermediate_size=1024,  # 4 * hidden, ViT's ratio
        num_labels=10,
    )
    torch.manual_seed(0)
    return ViTForImageClassification(config).float().eval()


@functools.lru_cache(maxsize=1)
def _images() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)
    x = (x.repeat(1, 3, 1, 1) - 0.5) / 0.5  # (N, 3, 32, 32) in [-1, 1]
    return x, torch.tensor(digits.target, dtype=torch.long)


def _batches(rows: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _images()
    x, y = x[rows.start : rows.stop], y[rows.start : rows.stop]
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)]


def calibration_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _batches(CALIBRATION)


def eval_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _batches(EVAL)


def forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(pixel_values=batch[0]).logits  # (B, 10)


def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), batch[1])
