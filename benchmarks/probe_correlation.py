"""How good is the probes' cheap end-to-end estimate, and what does it save?

For each model (tiny BERT and GPT-2 built from configs with random init, an MLP, a CNN):

1. naive: run the whole model once per (layer, precision) with only that layer lowered
   and measure the end-to-end error (relative L2 of the outputs vs fp32);
2. probe: ``autoprec.probe.probe(..., e2e="none")`` — one fp32 pass with shadow hooks and
   one backward — giving every pair's cheap estimate.

Prints the Spearman rank correlation between estimates and measured errors (target
>= 0.9), the same for the layer's local error alone (what a probe without propagation
would rank by), the share of estimates within 2x of the measurement, and the cost of
each approach in forward-pass equivalents and CPU seconds.

CPU seconds understate the saving: on these CPUs fp16/bf16 matmuls run ~90x slower than
fp32 (docs/overview.md), and the probe and the naive loop lower each layer once per precision
alike; the forward-pass count is what a GPU pays.

Run: ``.venv/bin/python -m benchmarks.probe_correlation`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from scipy.stats import spearmanr
from torch import nn

from autoprec.probe import probe
from autoprec.probe.e2e import choose
from autoprec.probe.layers import lowered_alone, select_layers
from autoprec.trace import trace
from autoprec.workload.loading import ModelSpec, default_forward
from autoprec.workload.scoring import reference, score

PRECISIONS = ("tf32", "bf16", "fp16", "fp8")
N_BATCHES = 4


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bert() -> tuple[nn.Module, list[Any]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=64)
    g = _gen()
    return BertModel(cfg).eval(), [
        {"input_ids": torch.randint(0, 512, (8, 32), generator=g)} for _ in range(N_BATCHES)]


def gpt2() -> tuple[nn.Module, list[Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    g = _gen()
    return GPT2LMHeadModel(cfg).eval(), [
        {"input_ids": torch.randint(0, 512, (8, 32), generator=g)} for _ in range(N_BATCHES)]


def mlp() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256),
        nn.ReLU(inplace=True), nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 10),
    ).eval()
    g = _gen()
    return model, [torch.randn(32, 64, generator=g) for _ in range(N_BATCHES)]


def cnn() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).eval()
    g = _gen()
    return model, [torch.randn(8, 3, 16, 16, generator=g) for _ in range(N_BATCHES)]


MODELS: dict[str, Callable[[], tuple[nn.Module, list[Any]]]] = {
    "bert": bert, "gpt2": gpt2, "mlp": mlp, "cnn": cnn}


def naive(model: nn.Module, batches: list[Any]) -> tuple[dict[tuple[str, str], float], float]:
    """One whole-model run per (layer, precision), only that layer lowered."""
    spec = ModelSpec(path=Path("<experiment>"), name="x", build_model=lambda: model,
                     calibration_data=lambda: batches, forward=default_forward)
    started = time.monotonic()
    graph = trace(model, batches[0], tracers=("hooks",))
    ref = reference(spec, model, batches)
    errors = {}
    for layer in select_layers(model, graph, PRECISIONS):
        for p in layer.precisions:
            with lowered_alone(layer, p):
                errors[(layer.path, p)] = score(spec, model, batches, ref).error
    return errors, time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of " + ",".join(MODELS))
    ap.add_argument("--probes", type=int, default=1, help="random projections per batch")
    args = ap.parse_args()
    try:  # quiet HF warnings about the tiny configs
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    torch.set_num_threads(2)
    header = (f"{'model':<6}{'layers':>7}{'pairs':>6}{'rho est':>9}{'rho local':>10}"
              f"{'in 2x':>7}{'e2e auto':>9}{'probe fwd':>10}{'naive fwd':>10}{'ratio':>7}"
              f"{'probe s':>9}{'naive s':>9}")
    print(header)
    print("-" * len(header))
    rhos = []
    for name in args.models.split(","):
        model, batches = MODELS[name]()
        measured, naive_s = naive(model, batches)
        layers = select_layers(model, trace(model, batches[0], tracers=("hooks",)), PRECISIONS)
        started = time.monotonic()
        table = probe(model, batches, PRECISIONS, e2e="none", probes=args.probes,
                      progress=False)
        probe_s = time.monotonic() - started
        # What e2e="auto" would have measured (estimates within 2x of a 0.01 budget).
        estimates = {(r.layer, r.precision): r.cheap_estimate for r in table}
        hard = set(table.hard_excluded())
        auto = len(choose("auto", layers, estimates, hard, budget=0.01, has_metric=False))
        keys = [k for k in measured if not table.row(*k).hard and math.isfinite(measured[k])]
        meas = [measured[k] for k in keys]
        est = [table.row(*k).cheap_estimate for k in keys]
        loc = [table.row(*k).local_error for k in keys]
        rho = spearmanr(est, meas).statistic
        rho_local = spearmanr(loc, meas).statistic
        within = sum(m / 2 <= e <= 2 * m for e, m in zip(est, meas)) / len(keys)
        cost, naive_cost = table.meta["cost_total"], len(measured) + 1  # + the reference
        rhos.append(rho)
        print(f"{name:<6}{table.meta['layers']:>7}{len(keys):>6}{rho:>9.3f}{rho_local:>10.3f}"
              f"{within:>7.0%}{auto:>9}{cost:>10.0f}{naive_cost:>10}"
              f"{naive_cost / cost:>6.1f}x{probe_s:>9.1f}{naive_s:>9.1f}")
    print("-" * len(header))
    print(f"Spearman (cheap estimate vs measured e2e): min {min(rhos):.3f}, "
          f"mean {sum(rhos) / len(rhos):.3f}; target >= 0.9")
    print("fwd = forward-pass equivalents over the calibration set (a backward counts 2); "
          "naive = one pass per (layer, precision) + the fp32 reference.")


if __name__ == "__main__":
    main()
