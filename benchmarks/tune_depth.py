"""How tuning time grows with depth: the same decoder tuned at 4 / 8 / 16 / 32 / 64 blocks.

Model: HF ``GPT2LMHeadModel`` from a ``GPT2Config`` (n_embd 256, 4 heads, MLP 1024,
vocabulary 1024, context 64, ``use_cache=False``), random init (seed 0), and optionally a
Llama-shaped ``LlamaForCausalLM`` with grouped-query attention (hidden 256, 8 heads, 2 KV
heads, MLP 688 -> 704). Nothing is downloaded. Data: seeded random token ids, 2
calibration and 2 eval batches of 4 x 64 tokens (as ``examples/gpt``).

Each depth is tuned end to end (``autoprec.tune``: ``--max-error 0.01 --target h100
--batch-size 256``, no tracking, a fresh study and probe cache) and the script prints, per
depth: wall time per stage (trace, probes, planner, the search's model evaluations, the
rest: study bookkeeping, compaction, writing), model forwards (calls of the root module:
references, trace, probes, evaluations), plans priced by the planner, the result's
estimated speed-up on the target, the speed-ups of the one-line alternatives (uniform
tf32, one global bf16 / fp16 autocast) and the growth exponent ``b`` of ``time ~ a * L^b``
fitted over the depths (L = GEMM layers).

    python -m benchmarks.tune_depth                       # 4 16 64 (GPT-2)
    python -m benchmarks.tune_depth --blocks 8 32 --llama 32

Wall times are this machine's under its current load (printed: the 1-minute load average
before and after); the shape of the growth is the point, not the seconds.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import autoprec.tuning.prepare as prepare_mod
import autoprec.tuning.tune as tune_mod
from autoprec.cost import CostModel, get_profile
from autoprec.policy import Policy
from autoprec.pricing.target import Target
from autoprec.search import planner as planner_mod
from autoprec.study.objective import PlanScorer
from autoprec.workload.loading import ModelSpec
from benchmarks.tables import load_average, load_line, markdown

VOCAB, CONTEXT, B, T = 1024, 64, 4, 64


def build_gpt2(blocks: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=256, n_layer=blocks,
                     n_head=4, n_inner=1024, use_cache=False, bos_token_id=None,
                     eos_token_id=None)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).float().eval()


def build_llama(blocks: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # GQA: 8 query heads share 2 KV heads (head dim 32); MLP 704 (~ 8/3 x 256, 16-aligned)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=blocks, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=CONTEXT, use_cache=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().eval()


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (B, T), generator=g) for _ in range(n)]  # each (B, T)


def _forward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch).logits  # (B, T, V)


def spec(kind: str, blocks: int) -> ModelSpec:
    build = build_gpt2 if kind == "gpt2" else build_llama
    return ModelSpec(path=Path(__file__), name=f"{kind}{blocks}",
                     build_model=functools.partial(build, blocks),
                     calibration_data=functools.partial(_batches, 1, 2),
                     eval_data=functools.partial(_batches, 2, 2), forward=_forward)


class Clock:
    """Seconds per stage, by wrapping the stage functions tune calls."""

    def __init__(self, forwards: list[int]) -> None:
        self.forwards = forwards  # [model forwards so far]
        self.f: dict[str, int] = defaultdict(int)  # model forwards per stage
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.first: dict[str, Any] = {}  # stage -> the first call's first argument

    @contextmanager
    def patch(self, owner: Any, name: str, stage: str) -> Iterator[None]:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0, f0 = time.perf_counter(), self.forwards[0]
            if a:
                self.first.setdefault(stage, a[0])
            try:
                return fn(*a, **k)
            finally:
                self.s[stage] += time.perf_counter() - t0
                self.f[stage] += self.forwards[0] - f0
                self.n[stage] += 1

        setattr(owner, name, timed)
        try:
            yield
        finally:
            setattr(owner, name, fn)


def run_one(kind: str, blocks: int, workdir: Path) -> dict[str, Any]:
    forwards = [0]
    clock = Clock(forwards)
    sp = spec(kind, blocks)
    build = sp.build_model

    def counted() -> nn.Module:  # every forward of the root module is one model forward
        net = build()
        net.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        return net

    sp = ModelSpec(path=sp.path, name=sp.name, build_model=counted,
                   calibration_data=sp.calibration_data, eval_data=sp.eval_data,
                   forward=sp.forward)
    stages: list[tuple[Any, str, str]] = [
        (prepare_mod, "trace", "trace"), (prepare_mod, "probe", "probe"),
        (Target, "plan_cost", "cost"), (planner_mod.Planner, "__init__", "planner"),
        (PlanScorer, "error", "evaluate")]
    t0 = time.perf_counter()
    with _patches(clock, stages):
        res = tune_mod.tune(sp, max_error=0.01, target="h100", batch_size=256,
                            out=workdir / f"{sp.name}.yaml", progress=False,
                            cache_dir=workdir / "cache", trials=40)
    total = time.perf_counter() - t0
    pl = clock.first["planner"]
    cost = CostModel(res.search.graph, get_profile("h100"), batch_size=256)
    alt = {p: cost.speedup(Policy(default=p)) for p in ("tf32", "bf16", "fp16")}
    stage = {k: clock.s.get(k, 0.0) for k in ("trace", "probe", "cost", "planner", "evaluate")}
    stage["other"] = total - sum(stage.values())
    layers = len([n for n in res.search.graph.gemm_nodes if n.is_leaf])
    return {"model": kind, "blocks": blocks, "layers": layers, "total": total, **stage,
            "forwards": forwards[0], "fwd_trace": clock.f["trace"], "fwd_probe": clock.f["probe"],
            "fwd_eval": clock.f["evaluate"], "evaluated": clock.n["evaluate"],
            "fwd_other": forwards[0] - clock.f["trace"] - clock.f["probe"] - clock.f["evaluate"],
            "evaluations": res.search.evaluations, "trials": res.search.trials,
            "priced": pl.priced, "method": pl.method, "speedup": res.est_speedup,
            "error": res.error, "feasible": res.feasible, **{f"alt_{k}": v for k, v in alt.items()}}


@contextmanager
def _patches(clock: Clock, stages: list[tuple[Any, str, str]]) -> Iterator[None]:
    if not stages:
        yield
        return
    (owner, name, stage), rest = stages[0], stages[1:]
    with clock.patch(owner, name, stage), _patches(clock, rest):
        yield


def fit_exponent(layers: list[int], seconds: list[float]) -> float:
    """b of seconds ~ a * layers^b (least squares in log-log)."""
    if len(layers) < 2:
        return math.nan
    return float(np.polyfit(np.log(layers), np.log(seconds), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="*", default=[4, 16, 64])
    ap.add_argument("--llama", type=int, nargs="*", default=[],
                    help="also tune a Llama-shaped GQA model at these depths")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--planner-check", type=int, nargs="*", default=[],
                    help="compare the planner with a long descent at these depths (GPT-2)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.001, 0.003, 0.01])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (imports outside the timing)
    import transformers.models.llama.modeling_llama  # noqa: F401
    if args.planner_check:
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.planner_check:
                print("\n".join(planner_check("gpt2", n, args.budgets, Path(tmp) / str(n))))
        return
    rows = []
    load0 = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        for kind, depths in (("gpt2", args.blocks), ("llama", args.llama)):
            for n in depths:
                row = run_one(kind, n, Path(tmp) / f"{kind}{n}")
                rows.append(row)
                print(_line(row), flush=True)
    load1 = load_average()
    print()
    print(f"{load_line(load0, load1)}; torch threads {args.threads}")
    print()
    print(_table(rows))
    for kind in ("gpt2", "llama"):
        sel = [r for r in rows if r["model"] == kind]
        if len(sel) >= 2:
            print(f"{kind}: time ~ L^{fit_exponent([r['layers'] for r in sel], [r['total'] for r in sel]):.2f}"
                  f" (L = GEMM layers {', '.join(str(r['layers']) for r in sel)})")


def _line(r: dict[str, Any]) -> str:
    return (f"{r['model']} {r['blocks']} blocks: {r['total']:.1f} s, {r['forwards']} forwards, "
            f"{r['priced']} plans priced ({r['method']}), {r['speedup']:.2f}x")


COLUMNS = ("model", "blocks", "GEMM layers", "total s", "trace", "probes", "cost model",
           "planner", "evaluations", "other", "forwards (refs+trace+probes+evals)",
           "plans priced", "speed-up", "tf32 / bf16 / fp16", "error")


def _cells(r: dict[str, Any]) -> list[str]:
    return [r["model"], str(r["blocks"]), str(r["layers"]),
            *(f"{r[k]:.1f}" for k in ("total", "trace", "probe", "cost", "planner", "evaluate",
                                      "other")),
            f"{r['forwards']} ({r['fwd_other']}+{r['fwd_trace']}+{r['fwd_probe']}+"
            f"{r['fwd_eval']} in {r['evaluated']} runs)", str(r["priced"]),
            f"{r['speedup']:.2f}x", f"{r['alt_tf32']:.2f} / {r['alt_bf16']:.2f} / "
            f"{r['alt_fp16']:.2f}", f"{r['error']:.4f}"]


def _table(rows: list[dict[str, Any]]) -> str:
    return markdown(COLUMNS, map(_cells, rows))


def planner_check(kind: str, blocks: int, budgets: list[float], workdir: Path) -> list[str]:
    """The planner's best plan (fastest predicted within budget) against a much longer run:
    the full Lagrangian descent with block moves (``planner.descend``) from every uniform
    start, per budget. Prints the two times, the ratio and the plans each priced."""
    from autoprec.tuning.config import TuneConfig

    cfg = TuneConfig(max_error=0.01, target="h100", batch_size=256,
                     out=workdir / "check.yaml", progress=False,
                     cache_dir=workdir / "cache").validated()
    prep = prepare_mod.prepare(spec(kind, blocks), cfg)
    space = prepare_mod.make_space(prep, cfg)
    est = prep.table.estimate
    rows = []
    for b in budgets:
        t0 = time.perf_counter()
        pl = planner_mod.Planner(space, prep.cost, est, budget=b)
        t1 = time.perf_counter()
        ok = pl.preds <= b
        mine = float(pl.times[ok].min())
        found = planner_mod.descend(planner_mod.PlanSpace(space, prep.cost, est), b,
                                    lambdas=np.geomspace(1e-3, 1e3, 25), max_steps=400)
        t2 = time.perf_counter()
        long = min(t for t, p in found.values() if p <= b)
        rows.append([f"{b:g}", f"{mine:.4g}", pl.method, pl.priced, f"{t1 - t0:.1f}",
                     f"{long:.4g}", len(found), f"{t2 - t1:.1f}", f"{mine / long:.4f}"])
    cols = ("budget", "planner (s/fwd)", "method", "plans priced", "planner s",
            "long descent (s/fwd)", "plans priced", "descent s", "planner / long")
    return [f"planner check, {kind} {blocks} blocks ({len(space.variables)} variables, "
            f"space {space.size:.3g} plans):", *markdown(cols, rows).splitlines()]


if __name__ == "__main__":
    main()
