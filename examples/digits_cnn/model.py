"""A small CNN trained on scikit-learn's handwritten digits (real data, real trained weights).

Data: ``sklearn.datasets.load_digits`` — 1797 greyscale 8x8 images of digits 0-9 (pixel
values 0-16), bundled with scikit-learn. A stratified 75/25 split (seed 0): 1347 train,
450 test. Calibration = the first 256 train images (4 batches of 64), eval = the whole test
split (450 images, 6 batches of 75).

Weights: trained by ``build_model()`` itself — Adam, 10 epochs of the train split, seeded,
one thread, a few seconds on a CPU — and memoised for the process, so every call returns
the same weights without a file cache that could go stale. Test accuracy 0.984 (443/450).

Metric: accuracy (a drop of 0.005 is one test image in 450, rounded up). Loss: cross-entropy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "digits_cnn"
SEED = 0
BATCH = 64
CALIBRATION_IMAGES = 256
EVAL_BATCHES = 6
EPOCHS = 10
LR = 3e-3


class DigitsCNN(nn.Module):
    """conv 1->16 -> conv 16->32 -> pool -> fc 512->64 -> fc 64->10 (~0.34 MMAC per image).

    fc1 is fp8-eligible (dims multiples of 16); the convs and the 10-way head are not,
    as in most real classifiers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 8, 8)
        h = F.relu(self.conv1(x))  # (B, 16, 8, 8)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)  # (B, 32, 4, 4)
        h = F.relu(self.fc1(h.flatten(1)))  # (B, 64)
        return self.head(h)  # (B, 10) logits


@functools.lru_cache(maxsize=1)
def split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): the stratified 75/25 split (seed 0) of the module
    docs, images ``(N, 1, 8, 8)`` scaled to [0, 1]. ``benchmarks/train_digits.py`` trains on
    it too."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.long)  # (1797,)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.25, random_state=SEED, stratify=y.numpy()
    )
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


@functools.lru_cache(maxsize=1)
def _trained_state() -> dict[str, torch.Tensor]:
    x, y, _, _ = split()
    torch.manual_seed(SEED)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(SEED)
    model.train()
    # One thread: the same weights whatever the core count (a parallel reduction's order
    # changes the rounding), and these GEMMs are too small to gain from more; on a busy
    # 2-core box two threads trained 8x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(EPOCHS):
            order = torch.randperm(len(y), generator=g)
            for i in range(0, len(y), BATCH):
                j = order[i : i + BATCH]
                opt.zero_grad()
                F.cross_entropy(model(x[j]), y[j]).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_model() -> nn.Module:
    model = DigitsCNN()
    model.load_state_dict(_trained_state())
    return model.eval()


def _batches(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)]


def calibration_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y, _, _ = split()
    return _batches(x[:CALIBRATION_IMAGES], y[:CALIBRATION_IMAGES])


def eval_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, _, x, y = split()
    return list(zip(x.chunk(EVAL_BATCHES), y.chunk(EVAL_BATCHES)))  # 6 batches of 75


def forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])  # the labels are for metric and loss only


def metric(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    return float((outputs.argmax(1) == batch[1]).float().mean())


def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), batch[1])
