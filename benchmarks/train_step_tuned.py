"""The tuned training plan of ``train_step_priced``: ``autoprec.tune(form="train")`` run for
real on a reduced-depth copy of the model, its per-layer decisions mapped onto the full one.

A full tune of GPT-2 124 M (12 blocks) or a 1.1 B Llama (22 layers) probes every layer in
every precision on this 2-core CPU (tens of minutes per model and target), so the tune runs
on the same config with **3 blocks** (the same widths, heads, vocabulary): the first, one
inner and the last block. Its decisions map by role — block 0 to block 0, the inner block to
every inner block, the last block to the last, everything outside the blocks (embeddings,
final norm, LM head) by its own path — because first / inner / last is what the published
recipes tell apart (TE and Megatron's ``first_last_layers_bf16``; NVFP4 pre-training's
high-precision last layers).

Data: real text, tokenizer-free — the docstrings of a few stdlib modules as UTF-8 bytes, one
token id per byte (ids 0..255 lie in both vocabularies); calibration and eval are 2 batches
of 2 x 128 tokens each, from disjoint stretches of the text. Loss: next-token cross-entropy.
The tune prices plans at the micro-batch of the priced table in tokens (``batch_size`` =
tokens / 128 sequences of 128), restricted to fp32 / tf32 / bf16 / fp16 / fp8 on both
devices (the formats the TE and torchao anchors run; B200's mxfp8 / nvfp4 are left out).
"""

from __future__ import annotations

import collections
import inspect
import json
import math
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from autoprec.cost import CostModel, get_profile
from autoprec.cost.step import StepPart
from autoprec.plan.compile import assignment
from autoprec.policy import Policy

SEQ, CALIB_B = 128, 2  # calibration batches: 2 sequences of 128 byte-tokens
REDUCED_BLOCKS = 3  # first, one inner, last
PRECISIONS = "fp32,tf32,bf16,fp16,fp8"
MAX_ERROR = 0.05  # relative L2 of the logits (issue 46's repro budget)
TRIALS = 10
BLOCK_NAMES = ("h", "layers")  # GPT2's transformer.h.N, Llama's model.layers.N


def text_ids(n: int) -> torch.Tensor:
    """``n`` byte-tokens of real English text: stdlib docstrings as UTF-8 bytes."""
    docs: list[str] = []
    for mod in (json, os, collections, pathlib, inspect, math):
        docs.append(mod.__doc__ or "")
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if not name.startswith("_") and isinstance(doc, str):
                docs.append(doc)
    raw = "\n".join(docs).encode("utf-8")
    if len(raw) < n:
        raise ValueError(f"text_ids: {len(raw)} bytes of docstrings, {n} asked")
    return torch.tensor(list(raw[:n]), dtype=torch.long)


def data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Calibration and eval batches, each 2 x (CALIB_B, SEQ) token ids."""
    ids = text_ids(4 * CALIB_B * SEQ).view(4, CALIB_B, SEQ)
    return [ids[0], ids[1]], [ids[2], ids[3]]


def logits(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch).logits  # (B, T, V)


def next_token_loss(outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    lg = outputs[:, :-1].float()  # position t predicts token t+1: (B, T-1, V)
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), batch[:, 1:].reshape(-1))


def block_of(path: str) -> int | None:
    """The transformer block a module path lies in (None: outside the blocks)."""
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in BLOCK_NAMES and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _with_block(path: str, new: int) -> str:
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in BLOCK_NAMES and parts[i + 1].isdigit():
            parts[i + 1] = str(new)
            return ".".join(parts)
    return path


def map_blocks(rules: dict[str, str], reduced: int, full: int) -> dict[str, str]:
    """Rules of a ``reduced``-block model onto a ``full``-block one: the first and last
    blocks to the first and last, every inner block's rules to every inner block."""
    out: dict[str, str] = {}
    for path, prec in rules.items():
        b = block_of(path)
        if b is None or b == 0:
            targets = [path]
        elif b == reduced - 1:
            targets = [_with_block(path, full - 1)]
        else:
            targets = [_with_block(path, k) for k in range(1, full - 1)]
        out.update(dict.fromkeys(targets, prec))
    return out


@dataclass
class Kept:
    """An fp8-eligible GEMM leaf the tuned plan left above fp8, and why."""

    path: str
    precision: str
    why: str


@dataclass
class Tuned:
    """A tune's outcome on the reduced model, and its plan mapped to the full one."""

    target: str
    policy: Policy  # as tune wrote it (reduced model)
    full: Policy  # mapped onto the full model
    seconds: float
    error: float
    est_speedup: float
    bf16_est: float | None  # tune's own bf16-autocast row, same cost model
    kept: list[Kept]
    table: str  # tune's plan table (format_rows)


def _fp8_reason(sens: Any, path: str) -> str:
    """The probe's verdict on ``path`` in fp8: its reason, else its end-to-end error."""
    if sens is None or len(sens) == 0:
        return ""
    rows = sens[(sens["layer"] == path) & (sens["precision"] == "fp8")]
    if rows.empty:
        return "not probed in fp8"
    r = rows.iloc[0]
    if isinstance(r.get("reason"), str) and r["reason"]:
        return str(r["reason"])
    if math.isfinite(r["e2e_error"]):
        return f"fp8 alone: e2e error {r['e2e_error']:.3g} (budget {MAX_ERROR:g})"
    return (f"fp8 alone: first-order error estimate {r['cheap_estimate']:.3g} "
            f"(budget {MAX_ERROR:g})")


def kept_high(result: Any, model: torch.nn.Module, target: str, batch: int) -> list[Kept]:
    """The fp8-eligible leaves of the reduced model the plan did not put in fp8, each with
    the policy's reason, the probe's fp8 verdict and what fp8 there alone would save on the
    step (priced on the target at the tune's batch)."""
    graph, pol = result.search.graph, result.policy
    cm = CostModel(graph, get_profile(target), batch, step=StepPart(fp8_backward="fp8"))
    base = cm.estimate(pol)
    prec = assignment(pol, model)
    out = []
    for n in graph:
        if not (n.is_leaf and "fp8" in n.allowed) or prec.get(n.path) == "fp8":
            continue
        trial = Policy(default=pol.default, layers={**pol.layers, n.path: "fp8"}, form="train")
        gain = (base - cm.estimate(trial)) * 1e3
        why = [w for w in (pol.reasons.get(n.path, ""),
                           _fp8_reason(result.search.sensitivity, n.path)) if w]
        why.append(f"fp8 here alone would change the step by {-gain:+.3f} ms")
        out.append(Kept(n.path, prec.get(n.path, pol.default), "; ".join(why)))
    return out


def run_tune(build: Callable[[int], torch.nn.Module], full_blocks: int, target: str,
             batch: int, out: Path, name: str) -> Tuned:
    """Tune the reduced model for the train form on ``target`` and map the plan onto
    ``full_blocks``. ``batch``: sequences of SEQ tokens the plans are priced at."""
    import time

    from autoprec.api import tune
    from autoprec.evaluation.rows import format_rows

    model = build(REDUCED_BLOCKS)
    calib, ev = data()
    t0 = time.perf_counter()
    result = tune(model, calibration=calib, eval=ev, forward=logits,
                           loss=next_token_loss, name=name, target=target, form="train",
                           batch_size=batch, trials=TRIALS, max_error=MAX_ERROR,
                           precisions=PRECISIONS, out=out, progress=False)
    secs = time.perf_counter() - t0
    speed = result.plan.speed.to_dict() if result.plan.speed is not None else None
    bf16 = None
    if speed is not None:
        bf16 = next((r["est_speedup"] for r in speed["rows"]
                     if r["name"].startswith("bf16 (one global autocast")), None)
    pol = result.policy
    full = Policy(default=pol.default, form="train",
                  layers=map_blocks(dict(pol.layers), REDUCED_BLOCKS, full_blocks))
    return Tuned(target, pol, full, secs, result.plan.eval_error, result.est_speedup, bf16,
                 kept_high(result, model, target, batch), format_rows(speed) if speed else "")
