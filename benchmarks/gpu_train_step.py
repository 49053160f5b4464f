"""Real training steps timed on the device at hand: fp32, one global bf16 / fp16 autocast,
fp8 through torchao's float8 training, and autoprec training plans; ms per step and memory.

One step = ``zero_grad``, forward, cross-entropy loss, backward (through a GradScaler where
fp16 computes), ``AdamW.step`` over fp32 master weights: what a trainer's loop runs. The
model is a pre-LN GPT stack of ``nn.Linear`` layers (default d_model 2048, 16 heads,
4 blocks, seq 1024, micro-batch 8, vocab 8192; ``--tiny`` for a toy size). Rows:

- ``fp32``: no autocast, TF32 off;
- ``bf16 autocast``: one global ``torch.autocast(bfloat16)``: ``TrainingArguments(bf16=True)``;
- ``fp16 autocast + scaler``: ``TrainingArguments(fp16=True)``;
- ``fp8 torchao tensorwise`` / ``fp8 torchao rowwise``: ``convert_to_float8_training`` on
  every block Linear (the head stays high, as torchao's and TE's recipes keep it) under a
  bf16 autocast: ``torch._scaled_mm`` for fprop, dgrad and wgrad. Only where
  ``torchao_fp8_kernels`` says the fp8 kernels run (CUDA SM >= 8.9; rowwise 9.0); elsewhere
  skipped with that reason (``--emulate-fp8`` runs torchao's emulation instead: checks the
  script, numbers meaningless);
- ``plan: bf16 + fp8 blocks``: an autoprec training plan (``default: bf16``, fp8 on the
  block Linears) through ``prepare_training``: the train form's fp8 backend (torchao where
  its kernels run); its fp8 leaves are audited on a real step first
  (``audit_fp8_training``: fprop, dgrad and wgrad ran in fp8 through torchao);
- ``tuned plan (tune --form train)`` (``--tune``, on by default on a GPU): first
  ``autoprec.tune(form="train")`` of this model on the device at hand for its stored profile
  (h200 on an H200; calibration two (2, seq) batches, priced at the micro-batch, budget
  ``--max-error``, search capped at ``--tune-seconds``), written to ``tuned.yaml`` beside the
  table; then its plan timed like the others, with what tune chose in the note;
- ``--policy FILE`` (repeatable): a written plan (e.g. from ``tune --form train`` on this
  model) applied the same way.

After the rows, on a GPU (``--calibrate``), the cost model's factors are fitted on
micro-benchmarks run here (``speed_source.calibrate_here``) and written to
``calibration.json``: the GPU-side check of the profile the priced tables use.

The file is also a model.py (``build_model``, ``calibration_data``, ``forward``, ``loss`` at
the default sizes): ``autoprec tune benchmarks/gpu_train_step.py --form train --target
h200`` writes a training plan for this very model, which ``--policy`` then times.

Each row starts from the same initial weights on a fresh copy; it runs ``--warmup`` steps,
then ``--steps`` timed ones (CUDA events, or wall clock on a CPU); the median is reported,
with the peak device memory of the row (``torch.cuda.max_memory_allocated``; a CPU has no
such counter: "n/a") and the bytes of the training state (parameters, gradients, AdamW's
two moments), counted from the tensors after the last step. A row that fails is recorded
with its error, not fatal. The table is written after every row (``train_step.csv`` and
``train_step.md`` under ``--out``, else $OUT, else ./gpu_train_step_out), so a run cut short
keeps what it measured; ``--time-limit`` stops starting new rows past that many seconds.
No ``torch.compile`` (eager steps: nothing to compile on a fresh machine). At the default
sizes on an H200 a row is ~15 steps of ~235 M parameters at 8 x 1024 tokens (seconds), the
tune a couple of minutes: the whole run stays well under 8 minutes.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

COLUMNS = ["row", "status", "ms_per_step", "speedup_vs_fp32", "vs_bf16_autocast",
           "peak_mem_mib", "state_mib", "final_loss", "fp8_backend", "note"]

# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LN transformer block: (B, T, C) -> (B, T, C); every GEMM an nn.Linear."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, H, T, C/H)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token embedding, ``n_layer`` blocks, final LayerNorm, vocabulary head."""

    def __init__(self, vocab: int, d: int, n_head: int, n_layer: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


#: The default sizes (the command line's defaults and the model.py below).
DEFAULTS = {"d_model": 2048, "heads": 16, "layers": 4, "seq": 1024, "batch": 8, "vocab": 8192}
MODEL_NAME = "gpu_train_step"


def build_model() -> nn.Module:
    """model.py: the default-size stack, seed 0 (the initialisation every row starts from)."""
    torch.manual_seed(0)
    d = DEFAULTS
    return GPT(d["vocab"], d["d_model"], d["heads"], d["layers"], d["seq"])


def calibration_data() -> list[torch.Tensor]:
    """model.py: two (batch, seq) batches of random token ids."""
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, DEFAULTS["vocab"], (DEFAULTS["batch"], DEFAULTS["seq"]),
                          generator=g) for _ in range(2)]


def forward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch)  # (B, T, V)


def loss(outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """model.py: next-token cross-entropy (position t predicts token t+1)."""
    logits = outputs[:, :-1].float()  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def block_linears(model: nn.Module) -> list[str]:
    """Paths of the block Linears (the fp8 candidates; the head stays high)."""
    return [p for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and p.startswith("blocks.")]


# --------------------------------------------------------------------------- rows


@dataclass
class Setup:
    """A row's model, ready to train: how its forward runs and what its step needs."""

    model: nn.Module
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext
    scaler: torch.amp.GradScaler | None = None
    fp8_backend: str = ""
    note: str = ""
    cleanup: list[Callable[[], None]] = field(default_factory=list)


@dataclass
class Row:
    name: str
    build: Callable[[nn.Module, torch.device], Setup]
    skip: str | None = None  # why this row does not run here


def _autocast(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    return lambda: torch.autocast(device.type, dtype=dtype)


def rows_for(device: torch.device, emulate_fp8: bool, policies: list[Path],
             tune: Callable[[], Any] | None = None) -> list[Row]:
    """The rows of the table, each with why it is skipped here (None: it runs); ``tune``:
    runs ``autoprec.tune --form train`` and returns (policy, note) for the tuned row."""
    from autoprec.device.capability import capability, torchao_fp8_kernels

    def fp8_torchao(recipe: str) -> Callable[[nn.Module, torch.device], Setup]:
        def build(model: nn.Module, dev: torch.device) -> Setup:
            from torchao.float8 import convert_to_float8_training

            from autoprec.lower.torchao_fp8 import float8_config

            emulate = not torchao_fp8_kernels(_BACKEND[recipe], dev)[0]
            cfg = float8_config(recipe, emulate=emulate)
            names = set(block_linears(model))
            convert_to_float8_training(model, config=cfg,
                                       module_filter_fn=lambda m, fqn: fqn in names)
            from torchao.float8.float8_linear import Float8Linear

            n = sum(isinstance(m, Float8Linear) for m in model.modules())
            return Setup(model, _autocast(dev, torch.bfloat16), fp8_backend=_BACKEND[recipe],
                         note=f"{n} Float8Linear ({recipe}{', emulate=True' if emulate else ''})")
        return build

    def plan(policy: Any, label: str) -> Callable[[nn.Module, torch.device], Setup]:
        def build(model: nn.Module, dev: torch.device) -> Setup:
            return plan_setup(model, dev, policy, label, emulate_fp8)
        return build

    def skip_fp8(backend: str) -> str | None:
        try:
            import torchao.float8  # noqa: F401
        except ImportError as err:
            return f"torchao does not import ({err}); pip install 'autoprec[train-fp8]'"
        ok, why = torchao_fp8_kernels(backend, device)
        return None if ok or emulate_fp8 else why

    bf16_ok, bf16_why = capability("bf16", None, device)
    fp16_ok, fp16_why = capability("fp16", None, device)
    rows = [
        Row("fp32", lambda m, d: Setup(m, note="TF32 off")),
        Row("bf16 autocast", lambda m, d: Setup(m, _autocast(d, torch.bfloat16),
                                                note="TrainingArguments(bf16=True)"),
            None if bf16_ok else bf16_why),
        Row("fp16 autocast + scaler",
            lambda m, d: Setup(m, _autocast(d, torch.float16), torch.amp.GradScaler(d.type),
                               note="TrainingArguments(fp16=True)"),
            None if fp16_ok else fp16_why),
        Row("fp8 torchao tensorwise", fp8_torchao("tensorwise"), skip_fp8("torchao")),
        Row("fp8 torchao rowwise", fp8_torchao("rowwise"), skip_fp8("torchao-rowwise")),
        Row("plan: bf16 + fp8 blocks", plan(None, "bf16 + fp8 blocks"),
            None if bf16_ok else bf16_why),
    ]
    if tune is not None:
        def tuned(model: nn.Module, dev: torch.device) -> Setup:
            policy, how = tune()  # the tune's own time is not the step's: outside time_row
            s = plan_setup(model, dev, policy, "tuned plan", emulate_fp8)
            s.note = f"{how}; {s.note}"
            return s

        rows.append(Row(TUNED_ROW, tuned, None if bf16_ok else bf16_why))
    rows += [Row(f"policy: {p.name}", plan(p, p.name)) for p in policies]
    return rows


TUNED_ROW = "tuned plan (tune --form train)"


def target_of(device: torch.device) -> str:
    """The stored profile of the GPU at hand (h100 / h200 / b200 / a100 / l4 / t4), "cpu"
    on a CPU; a GPU none of them names is priced as an h100."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((t for t in ("h200", "h100", "b200", "a100", "l4", "t4") if t in name), "h100")


def tuner(master: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
          device: torch.device, out_dir: Path, seconds: float,
          max_error: float) -> Callable[[], tuple[Any, str]]:
    """What the tuned row runs first: ``autoprec.tune(form="train")`` of a copy of the
    master on ``device`` for its stored profile, calibrated on two (2, seq) batches, priced
    at the micro-batch, the search capped at ``seconds``; the policy is written to
    ``out_dir/tuned.yaml``. Returns (policy, a note saying what tune found)."""

    def run() -> tuple[Any, str]:
        from autoprec.api import tune

        model = copy.deepcopy(master).to(device).eval()
        calib = [b[0][:2] for b in batches[:2]]
        ev = [b[0][:2] for b in batches[2:4]]
        t0 = time.perf_counter()
        res = tune(model, calibration=calib, eval=ev, forward=forward, loss=loss,
                            name="gpu_train_step", target=target_of(device), form="train",
                            batch_size=batches[0][0].shape[0], max_error=max_error,
                            trials=8, timeout=seconds, out=out_dir / "tuned.yaml",
                            progress=False)
        del model
        kept = sorted(p for p, v in res.policy.layers.items() if v != "fp8")
        fp8 = sorted(p for p, v in res.policy.layers.items() if v == "fp8")
        how = (f"tuned in {time.perf_counter() - t0:.0f}s on {res.policy.target or '?'}: "
               f"default {res.policy.default}, fp8 {fp8 or 'none'}, kept {kept or 'none'}, "
               f"est. {res.est_speedup:.2f}x, error {res.plan.eval_error:.3g}")
        return res.policy, how

    return run


def calibrate_device(device: torch.device, out_dir: Path) -> str:
    """The cost model's factors fitted on micro-benchmarks run here
    (``speed_source.calibrate_here``), written to ``out_dir/calibration.json``; a line."""
    import json

    from autoprec.cost import get_profile
    from autoprec.pricing.speed_source import calibrate_here

    t0 = time.perf_counter()
    fit = calibrate_here(get_profile(target_of(device)), str(device))
    cal = fit.calibration
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(
        {**cal.to_dict(), "labels": fit.labels, "predicted_s": fit.predicted,
         "measured_s": fit.measured}, indent=1, default=str))
    return (f"calibration of the {target_of(device)} profile here: {cal.n_samples} "
            f"micro-benchmarks in {time.perf_counter() - t0:.0f}s, rel. RMSE "
            f"{cal.rel_rmse if cal.rel_rmse is None else f'{cal.rel_rmse:.0%}'}; "
            "calibration.json")


_BACKEND = {"tensorwise": "torchao", "rowwise": "torchao-rowwise"}


def plan_setup(model: nn.Module, device: torch.device, policy: Any, label: str,
               emulate_fp8: bool) -> Setup:
    """An autoprec plan on ``model`` through ``prepare_training``; its fp8 leaves audited
    on one real step when they run through torchao."""
    from autoprec.apply.fp8_training_audit import audit_fp8_training
    from autoprec.device.capability import TORCHAO_FP8_RECIPES
    from autoprec.policy import Policy
    from autoprec.training.train import prepare_training

    if policy is None:
        policy = Policy.from_dict({"autoprec_policy": 1, "default": "bf16",
                                   "layers": {"blocks": "fp8"}})
    backend = None
    if emulate_fp8:
        from autoprec.device.capability import best_fp8_backend

        best, _ = best_fp8_backend(device, training=True)
        backend = best if best in TORCHAO_FP8_RECIPES else "torchao"
    setup = prepare_training(model, policy, fp8_backend=backend, device=device)
    handle = setup.handle
    note = f"{label}: {len(handle.wrapped)} wrappers"
    if handle.fp8_backend in TORCHAO_FP8_RECIPES:
        ids = torch.randint(0, model.head.out_features, (1, 16), device=device)
        rep = audit_fp8_training(handle, lambda: model(ids).float().logsumexp(-1).mean(),
                                 strict=False)
        model.zero_grad(set_to_none=True)
        note += (f"; audit: {len(rep.leaves)} fp8 leaves ran fprop/dgrad/wgrad in fp8 "
                 f"through torchao" if rep.ok else f"; AUDIT FAILED: {rep.errors[0]}")
    elif handle.fp8_backend:
        note += f"; fp8 on {handle.fp8_backend} ({handle.fp8_reason})"
    return Setup(model, scaler=setup.scaler, fp8_backend=handle.fp8_backend or "",
                 note=note, cleanup=[setup.remove])


# --------------------------------------------------------------------------- timing


@contextmanager
def tf32_off() -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, their gradients and the optimizer's state tensors."""
    n = 0
    for p in model.parameters():
        n += p.numel() * p.element_size()
        if p.grad is not None:
            n += p.grad.numel() * p.grad.element_size()
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    return n


def time_row(s: Setup, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
             warmup: int, steps: int) -> dict[str, Any]:
    """Warm-up, then ``steps`` timed training steps of ``s``: ms per step (median), peak
    memory, state bytes, the last loss."""
    model = s.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device.type == "cuda"

    def step(i: int) -> torch.Tensor:
        ids, labels = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with s.autocast():
            logits = model(ids)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        if s.scaler is None:
            loss.backward()
            opt.step()
        else:
            s.scaler.scale(loss).backward()
            s.scaler.step(opt)
            s.scaler.update()
        return loss

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup):
        step(i)
    times = []
    loss = torch.zeros(())
    for i in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(warmup + i)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step(warmup + i)
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms_per_step": statistics.median(times),
            "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else "n/a",
            "state_mib": state_bytes(model, opt) / 2**20, "final_loss": float(loss.detach())}


# --------------------------------------------------------------------------- output


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def write_table(out_dir: Path, header: list[str], rows: list[dict[str, Any]]) -> str:
    """Write train_step.csv and train_step.md; return the markdown table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train_step.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    md = "\n".join(lines)
    (out_dir / "train_step.md").write_text("\n".join(f"- {h}" for h in header) + "\n\n" + md
                                           + "\n")
    return md


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: $OUT, else ./gpu_train_step_out)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--tiny", action="store_true",
                    help="toy sizes (d 64, 2 blocks, seq 16, batch 2, vocab 256): checks "
                         "the script")
    for name, value in DEFAULTS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policy", type=Path, action="append", default=[],
                    help="also time this policy file on the model (repeatable)")
    ap.add_argument("--emulate-fp8", action="store_true",
                    help="run the fp8 rows through torchao's emulation where its kernels "
                         "do not run (checks the script; numbers meaningless)")
    ap.add_argument("--only", default=None,
                    help="comma-separated row names to run (default: all)")
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="start no new row after this many seconds")
    ap.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                    help="add the tuned row: autoprec.tune --form train on this model here "
                         "(default: on a GPU)")
    ap.add_argument("--tune-seconds", type=float, default=90.0,
                    help="the tuned row's search time limit")
    ap.add_argument("--max-error", type=float, default=0.05,
                    help="the tuned row's budget (relative L2 of the logits)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                    help="fit the cost model's factors on this device after the rows "
                         "(default: on a GPU)")
    args = ap.parse_args(argv)
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_train_step_out")  # CLI boundary
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_train_step: --device cuda, but CUDA is not available (torch "
              f"{torch.__version__})", file=sys.stderr)
        return 2
    if args.tiny:
        args.d_model, args.heads, args.layers, args.seq, args.batch, args.vocab = \
            64, 2, 2, 16, 2, 256
        args.warmup, args.steps = 1, 2
    d, H, L, T, B, V = args.d_model, args.heads, args.layers, args.seq, args.batch, args.vocab
    if d % 16 or d % H:
        print(f"gpu_train_step: --d-model {d} must be a multiple of 16 and of --heads {H}",
              file=sys.stderr)
        return 2
    missing = [p for p in args.policy if not p.is_file()]
    if missing:
        print(f"gpu_train_step: --policy {missing[0]}: no such file", file=sys.stderr)
        return 2
    from autoprec.device.capability import cpu_facts
    from autoprec.policy import PolicyWarning

    warnings.simplefilter("ignore", PolicyWarning)  # the built-in plan has no fingerprint
    t0 = time.perf_counter()
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"cpu: {cpu_facts()}")
    torch.manual_seed(0)
    master = GPT(V, d, H, L, T)  # the one initialisation every row starts from (CPU)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (B, T), generator=g).to(device),
                torch.randint(0, V, (B, T), generator=g).to(device)) for _ in range(4)]
    header = [f"device: {dev_name}; torch {torch.__version__}, python "
              f"{platform.python_version()}",
              f"model: GPT stack d={d} heads={H} layers={L} seq={T} micro-batch={B} "
              f"vocab={V}; {sum(p.numel() for p in master.parameters()) / 1e6:.1f} M "
              "parameters, fp32 masters, AdamW",
              f"timing: {'CUDA events' if device.type == 'cuda' else 'wall clock'}, median "
              f"of {args.steps} steps after {args.warmup} warm-up steps"
              + ("; TOY SIZES (--tiny): numbers meaningless" if args.tiny else "")]
    print("\n".join(header), flush=True)
    only = None if args.only is None else {s.strip() for s in args.only.split(",")}
    rows: list[dict[str, Any]] = []
    gpu = device.type == "cuda"
    tune = (tuner(master, batches, device, out_dir, args.tune_seconds, args.max_error)
            if (gpu if args.tune is None else args.tune) else None)
    for row in rows_for(device, args.emulate_fp8, args.policy, tune):
        if only is not None and row.name not in only:
            continue
        rec: dict[str, Any] = {"row": row.name}
        if row.skip is not None:
            rec.update(status="skipped", note=row.skip)
        elif time.perf_counter() - t0 > args.time_limit:
            rec.update(status="skipped", note=f"--time-limit {args.time_limit:g}s reached")
        else:
            rec.update(_run_row(row, master, batches, device, args.warmup, args.steps))
        rows.append(rec)
        _ratios(rows)
        print(f"{row.name:<28} {rec['status']:<8} {_fmt(rec.get('ms_per_step', ''))} ms  "
              f"{rec.get('note', '')}", flush=True)
        write_table(out_dir, [*header, f"wall time so far: {time.perf_counter() - t0:.0f}s"],
                    rows)
    if gpu if args.calibrate is None else args.calibrate:
        try:
            header.append(calibrate_device(device, out_dir))
        except Exception as err:  # the rows are the point: a failed fit is noted
            header.append(f"calibration failed: {type(err).__name__}: {err}"[:300])
        print(header[-1], flush=True)
    md = write_table(out_dir, [*header, f"wall time: {time.perf_counter() - t0:.0f}s"], rows)
    print(md)
    print(f"wrote {out_dir}/train_step.csv and train_step.md")
    return 0


def _run_row(row: Row, master: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """One row on a fresh copy of the master weights; an error becomes the row's status."""
    s: Setup | None = None
    try:
        model = copy.deepcopy(master).to(device).train()
        with tf32_off():
            s = row.build(model, device)
            out = time_row(s, batches, device, warmup, steps)
        return {"status": "ok", "fp8_backend": s.fp8_backend, "note": s.note, **out}
    except Exception as err:  # recorded in the table: one failing row keeps the others
        return {"status": "error", "note": f"{type(err).__name__}: {err}"[:300]}
    finally:
        for fn in (s.cleanup if s is not None else []):
            fn()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Speed-up over fp32 and over the bf16 autocast, for every row timed."""
    ms = {r["row"]: r.get("ms_per_step") for r in rows if r.get("status") == "ok"}
    for r in rows:
        m = r.get("ms_per_step")
        if r.get("status") != "ok" or not m:
            continue
        r["speedup_vs_fp32"] = ms["fp32"] / m if ms.get("fp32") else float("nan")
        r["vs_bf16_autocast"] = (ms["bf16 autocast"] / m if ms.get("bf16 autocast")
                                 else float("nan"))


if __name__ == "__main__":
    sys.exit(main())
