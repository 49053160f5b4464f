"""Train a small CNN on real data under a tuned fp16 policy; show what loss scaling prevents.

Data: scikit-learn's handwritten digits (1797 8x8 images, bundled; the same stratified
75/25 split, seed 0, as examples/digits_cnn): 1347 train, 450 test images.

1. Train the CNN in fp32 and tune a policy for it with ``autoprec.tuning.tune.tune``
   (target t4: fp16 is the only low precision it has; budget: accuracy drop <= 0.005;
   priced at a deployment batch of 4096 images — at the training batch of 64 every layer
   is launch-bound and the cost model rightly keeps everything fp32).
2. From the same initial weights, on the same batches in the same order, train it
   (``prepare_training`` + ``train_step``, the documented loop): in fp32; under the policy
   with its GradScaler; under the policy with loss scaling turned off.
3. The same three runs with the loss multiplied by 2**-17 (``--loss-factor``): the kind of
   small loss a sum normalised by a large token count, or split over many accumulation
   micro-batches, produces. Adam (eps 1e-16 here) is invariant to a constant loss factor,
   so in fp32 the factor changes nothing; any difference under the policy is fp16 range.
   The scaler's 2**16 leaves these gradients at half their natural size: still in range.
   At factor 1 the scaler's path shows the other way: early steps overflow at 2**16, are
   skipped, and the scale backs off.

Underflow is measured, not inferred (``UnderflowMeter``): the gradient arriving at each
fp16 layer's output is in that output's dtype (fp32 where the layer returns into fp32 code,
fp16 inside a fp16 region), and its backward uses it in fp16 for the layer's backward
GEMMs; a hook counts, over all
steps, the nonzero values of that (loss-scaled) gradient that round to zero in fp16
(|g| < 2**-25: "flushed") or land among fp16's subnormals (|g| < 2**-14: few bits left).
It also counts the weight-gradient entries of those layers that come out exactly zero.

fp16 convolutions run far slower than fp32 on some of this team's CPUs, so the CNN is tiny
(conv 1->8, conv 8->16, fc 256->32, fc 32->10). A few minutes on two cores.

    python -m benchmarks.train_digits                # the full run
    python -m benchmarks.train_digits --smoke        # ~1 min; used by the tests
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import math
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.plan import assignment, resolve
from autoprec.policy import Policy, PolicyWarning
from autoprec.training.train import prepare_training, train_step
from autoprec.workload.loading import ModelSpec

SEED = 0
BATCH = 64
FP16_NORMAL = 2.0**-14  # smallest fp16 normal


class TinyDigitsCNN(nn.Module):
    """conv 1->8 -> conv 8->16 -> pool -> fc 256->32 -> fc 32->10 (~10k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 8, 8)
        h = F.relu(self.conv1(x))  # (B, 8, 8, 8)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)  # (B, 16, 4, 4)
        h = F.relu(self.fc1(h.flatten(1)))  # (B, 32)
        return self.head(h)  # (B, 10) logits


def split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits split of ``examples/digits_cnn/model.py`` (its ``split``: one place)."""
    return _digits_example().split()


@functools.lru_cache(maxsize=1)
def _digits_example() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "examples" / "digits_cnn" / "model.py"
    spec = importlib.util.spec_from_file_location("digits_cnn_model", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def batches(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)]


def forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def accuracy(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    return float((outputs.argmax(1) == batch[1]).float().mean())


def ce_loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), batch[1])


def test_accuracy(model: nn.Module) -> float:
    _, _, xt, yt = split()
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in batches(xt, yt))
    return correct / len(yt)


# -- training ---------------------------------------------------------------------------


class UnderflowMeter:
    """How the fp16 layers' gradients fare (see the module docs), summed over steps.

    ``flushed`` / ``subnormal``: at each fp16 layer's output, the nonzero (loss-scaled) fp32
    gradient values that round to zero in fp16, or fall below its smallest normal — per
    boundary: a value flushed upstream arrives as an exact zero and is not counted again.
    ``zero_dw``: the fraction of those layers' weight-gradient entries that are exactly 0
    after backward — the cumulative effect (their dW comes out of an fp16 GEMM). Measured
    on the same layers in the fp32 run as a baseline (dead ReLUs give zeros there too).
    """

    def __init__(self, model: nn.Module, layers: list[str], at_outputs: bool) -> None:
        self.nonzero = self.flushed = self.subnormal = 0
        self.dw_zero = self.dw_total = 0
        self._weights = [model.get_submodule(p).weight for p in layers]
        self._handles = [model.get_submodule(p).register_forward_hook(self._on_forward)
                         for p in layers] if at_outputs else []

    def _on_forward(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if out.requires_grad and out.dtype == torch.float32:
            out.register_hook(self._on_grad)

    def _on_grad(self, g: torch.Tensor) -> None:
        a = g.detach().abs()
        nz = a > 0
        self.nonzero += int(nz.sum())
        self.flushed += int((nz & (g.detach().half() == 0)).sum())
        self.subnormal += int((nz & (a < FP16_NORMAL)).sum())

    def after_step(self) -> None:
        for w in self._weights:
            if w.grad is not None:
                self.dw_zero += int((w.grad == 0).sum())
                self.dw_total += w.grad.numel()

    @property
    def flushed_frac(self) -> float | None:
        return self.flushed / self.nonzero if self._handles and self.nonzero else None

    @property
    def subnormal_frac(self) -> float | None:
        return self.subnormal / self.nonzero if self._handles and self.nonzero else None

    @property
    def zero_dw_frac(self) -> float:
        return self.dw_zero / self.dw_total if self.dw_total else 0.0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class Run:
    name: str
    loss_factor: float
    scaler: str  # "-" (fp32), "yes", "off"
    accuracy: float
    final_scale: float | None
    skipped: int
    flushed: float | None
    subnormal: float | None
    zero_dw: float
    seconds: float


def train(init: nn.Module, policy: Policy | None, epochs: int, lr: float, loss_factor: float,
          scaler: bool | None, name: str, measured: list[str]) -> Run:
    """Train a copy of ``init`` (fp32 when ``policy`` is None); the batch order depends
    only on SEED. ``measured``: the policy's fp16 layers (see UnderflowMeter)."""
    model = copy.deepcopy(init)
    x, y, _, _ = split()
    torch.manual_seed(SEED)
    started = time.monotonic()
    setup = prepare_training(model, policy or Policy(), scaler=scaler)
    meter = UnderflowMeter(model, measured, at_outputs=policy is not None)
    # eps 1e-16: Adam's update m / (sqrt(v) + eps) is then invariant to a constant loss
    # factor (its default 1e-8 would dominate sqrt(v) once gradients are ~1e-8).
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-16)
    steps_per_epoch = math.ceil(len(y) / BATCH)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps_per_epoch)
    g = torch.Generator().manual_seed(SEED)

    def loss_fn(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return ce_loss(outputs, batch) * loss_factor

    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), BATCH):
            j = order[i : i + BATCH]
            train_step(setup, opt, (x[j], y[j]), loss_fn, forward=forward)
            meter.after_step()
            sched.step()
    acc = test_accuracy(model)  # under the policy, as it would be deployed
    meter.remove()
    setup.remove()
    for p in model.parameters():  # fp32 masters throughout
        assert p.dtype == torch.float32
    return Run(name, loss_factor, "-" if policy is None else ("yes" if setup.scaler else "off"),
               acc, setup.scale, setup.skipped_steps, meter.flushed_frac,
               meter.subnormal_frac, meter.zero_dw_frac, time.monotonic() - started)


# -- tuning -----------------------------------------------------------------------------


def fp32_trained(epochs: int, lr: float) -> nn.Module:
    """The model tune sees: the tiny CNN trained in fp32 (deterministic, seconds)."""
    torch.manual_seed(SEED)
    model = TinyDigitsCNN()
    run_model = copy.deepcopy(model)
    x, y, _, _ = split()
    opt = torch.optim.Adam(run_model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(SEED + 1)
    run_model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), BATCH):
            j = order[i : i + BATCH]
            opt.zero_grad()
            ce_loss(run_model(x[j]), (x[j], y[j])).backward()
            opt.step()
    return run_model.eval()


def tune_policy(workdir: Path, epochs: int, lr: float, trials: int) -> tuple[Policy, str]:
    from autoprec.tuning.tune import tune

    trained = fp32_trained(epochs, lr)
    x, y, xt, yt = split()
    spec = ModelSpec(
        path=Path(__file__), name="digits_tiny",
        build_model=lambda: copy.deepcopy(trained),
        calibration_data=lambda: batches(x[:256], y[:256]),
        eval_data=lambda: batches(xt, yt),
        forward=forward, metric=accuracy, loss=ce_loss,
    )
    res = tune(spec, max_drop=0.005, target="t4", precisions=["fp32", "fp16"], trials=trials,
               batch_size=4096, out=workdir / "digits_tiny-t4.yaml", progress=False)
    how = (f"tuned: {res.search.trials} trials, accuracy drop {res.plan.eval_error:+.4f} on "
           f"the test split (budget 0.005), est. speed-up {res.est_speedup:.2f}x on t4; {res.path}")
    return res.policy, how


# -- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[Run]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--loss-factor", type=float, default=2.0**-17,
                    help="small loss factor of the second set of runs")
    ap.add_argument("--trials", type=int, default=12, help="tune trials")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the tuned policy and its study go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="1 epoch, 3 trials (for tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.epochs, args.trials = 1, 3
    # One thread: on two shared cores, torch's thread pool oversubscribed them ~40x slower.
    torch.set_num_threads(1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="train_digits-"))
    # The fp32 runs train under an empty hand-made policy (no fingerprint: a warning each).
    warnings.simplefilter("ignore", PolicyWarning)

    t0 = time.monotonic()
    tuned, how = tune_policy(workdir, max(args.epochs, 3), args.lr, args.trials)
    fp16 = [p for p, prec in assignment(tuned, fp32_trained(max(args.epochs, 3),
                                                            args.lr)).items() if prec == "fp16"]
    if not fp16:
        # The cost model found no profitable fp16 layer: train under a hand-written
        # policy instead, and say so.
        how = f"tune kept every layer fp32 ({how}); using a hand-written policy"
        fp16 = ["conv2", "fc1"]
    else:
        how += (f"\ntuned plan: default {tuned.default}, rules {dict(tuned.layers)}; trained "
                "here with its fp16 layers as fp16 islands in fp32 (each returns fp32, where "
                "the meter reads the gradient its backward casts to fp16)")
    policy = Policy(default="fp32", layers=dict.fromkeys(fp16, "fp16"))
    print(how)
    print("policy layers: " + ", ".join(f"{k}: {v}" for k, v in policy.layers.items()))
    print(f"({time.monotonic() - t0:.0f}s)\n")

    torch.manual_seed(SEED)
    init = TinyDigitsCNN()  # every run starts from these weights
    res = resolve(policy, init)
    fp16 = [p for p, m in init.named_modules() if p and not list(m.children())
            and res[p].precision == "fp16"]
    runs = []
    for factor in (1.0, args.loss_factor):
        for name, pol, scaler in (("fp32", None, None), ("policy + GradScaler", policy, None),
                                  ("policy, no loss scaling", policy, False)):
            runs.append(train(init, pol, args.epochs, args.lr, factor, scaler, name, fp16))
    print_table(runs)
    return runs


def print_table(runs: list[Run]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    head = (f"{'run':<24} {'loss x':>6} {'scaler':>6} {'scale':>6} {'skipped':>7} "
            f"{'flushed':>8} {'subnorm':>8} {'dW == 0':>8} {'test acc':>8} {'vs fp32':>8} "
            f"{'time':>5}")
    print(head)
    print("-" * len(head))
    ref = {}
    for r in runs:
        if r.scaler == "-":
            ref[r.loss_factor] = r.accuracy
        delta = 100 * (r.accuracy - ref[r.loss_factor])
        scale = "-" if r.final_scale is None else f"{r.final_scale:g}"
        factor = "1" if r.loss_factor == 1 else f"2^{math.log2(r.loss_factor):g}"
        print(f"{r.name:<24} {factor:>6} {r.scaler:>6} {scale:>6} {r.skipped:>7} "
              f"{pct(r.flushed):>8} {pct(r.subnormal):>8} {pct(r.zero_dw):>8} "
              f"{100 * r.accuracy:>7.2f}% {delta:>+7.2f}p {r.seconds:>4.0f}s")
    print("\nflushed: nonzero gradient values at the fp16 layers' outputs (loss-scaled) that "
          "round to 0 in fp16;\nsubnorm: those below fp16's smallest normal 2^-14 (flushed "
          "included); dW == 0: weight-gradient\nentries of those layers exactly zero after "
          "backward (fp32 run: same layers, baseline); p: points.")


if __name__ == "__main__":
    main()
