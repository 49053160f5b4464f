"""Training under a policy on 2 gloo ranks (CPU): the model, data, policy and the rank
programs tests/train/test_distributed.py runs.

``run_ranks(program, world)`` spawns ``world`` processes, each with a gloo process group,
runs ``program(rank, world, workdir)`` in each and returns what every rank returned
(rank order). Every program starts from ``build()``'s weights (seed 0) and trains
``STEPS`` AdamW steps on ``data()``: the global batch of each step is ``GLOBAL_BATCH``
rows, split in equal halves between the ranks (``local_batch``), or given whole to each
rank (``replicated=True``: each rank computes what one process computes, so the result
is the single process's to the bit unless something is wrong).

The reported loss of a step is the global batch's: the mean of the ranks' local mean
losses (all-reduced), the same number on every rank.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from autoprec.policy import Policy
from autoprec.training.train import TrainingSetup, prepare_training, train_step

STEPS = 6
GLOBAL_BATCH = 8
LR = 1e-2

#: The plan: fp32 by default (embed, head), block 0 in bf16 with its fc1 in fp8 (the
#: emulated backend on a CPU: e4m3 forward, e5m2 gradients), block 1 in fp16 (so a
#: GradScaler) with its fc1 in mxfp8 (emulated: e4m3 blocks of 32, E8M0 scales). The
#: precisions a CPU trains in, each quantised format with its weight cache.
POLICY = {"autoprec_policy": 1, "default": "fp32", "form": "train",
          "layers": {"blocks.0": "bf16", "blocks.0.fc1": "fp8", "blocks.1": "fp16",
                     "blocks.1.fc1": "mxfp8"}}

Batch = tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    """A residual MLP block (d -> 2d -> d): the unit FSDP2 shards (torchtitan shards each
    transformer block, then the root)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d)
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """embed (16 -> 32), two Blocks, head (32 -> 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 16)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, 4)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def policy() -> Policy:
    return Policy.from_dict(POLICY)


def data(steps: int = STEPS, batch: int = GLOBAL_BATCH) -> list[Batch]:
    """One global batch per step: 16 features, a learnable 4-way labelling."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def loss_fn(outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch[0])


def local_batch(batch: Batch, rank: int, world: int, replicated: bool) -> Batch:
    if replicated:
        return batch
    n = batch[0].shape[0] // world
    return batch[0][rank * n:(rank + 1) * n], batch[1][rank * n:(rank + 1) * n]


# -- one process ---------------------------------------------------------------------------


def single_process(steps: int = STEPS, fp8_backend: str | None = None,
                   max_grad_norm: float | None = None) -> dict[str, Any]:
    """One process on the whole global batches: ``losses`` per step, the final fp32
    ``weights`` and (with ``max_grad_norm``) the ``grad_norms`` before clipping."""
    model = build()
    with prepare_training(model, policy(), fp8_backend=fp8_backend) as setup:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        steps_ = [train_step(setup, opt, b, loss_fn, forward, max_grad_norm=max_grad_norm)
                  for b in data(steps)]
    return {"losses": [r.loss for r in steps_], "grad_norms": [r.grad_norm for r in steps_],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# -- the engines -------------------------------------------------------------------------


def shard(model: Net) -> None:
    """FSDP2 in torchtitan's order: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def fsdp2_setup(order: str = "policy-first", fp8_backend: str | None = None
                ) -> tuple[nn.Module, TrainingSetup]:
    """The model under the policy and FSDP2: ``policy-first`` (prepare_training, then
    fully_shard per block and the root: the documented order) or ``shard-first``."""
    model = build()
    if order == "policy-first":
        setup = prepare_training(model, policy(), fp8_backend=fp8_backend)
        shard(model)
    else:
        shard(model)
        setup = prepare_training(model, policy(), fp8_backend=fp8_backend)
    return model, setup


def ddp_setup(order: str = "policy-first") -> tuple[nn.Module, TrainingSetup]:
    """The model under the policy and DDP: ``policy-first`` (prepare_training on the
    model, then DDP) or ``wrap-first`` (prepare_training on the DDP wrapper)."""
    model = build()
    if order == "policy-first":
        setup = prepare_training(model, policy())
        setup.model = nn.parallel.DistributedDataParallel(model)
    else:
        setup = prepare_training(nn.parallel.DistributedDataParallel(model), policy())
    return setup.model, setup


def global_loss(local: float, world: int) -> float:
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def train(model: nn.Module, setup: TrainingSetup, opt: torch.optim.Optimizer, rank: int,
          world: int, batches: list[Batch], replicated: bool = False,
          grad_norms: list[float | None] | None = None,
          max_grad_norm: float | None = None) -> list[float]:
    """The global loss of each step (and each step's gradient norm before clipping
    appended to ``grad_norms`` when given)."""
    out = []
    for b in batches:
        r = train_step(setup, opt, local_batch(b, rank, world, replicated), loss_fn, forward,
                       max_grad_norm=max_grad_norm)
        out.append(global_loss(r.loss, world))
        if grad_norms is not None:
            grad_norms.append(r.grad_norm)
    return out


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, unsharded (FSDP2's DTensors gathered), on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.removeprefix("module."): v.detach().clone() for k, v in sd.items()}


def local_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of the parameters, their gradients and the optimizer state
    (FSDP2: the rank's shards)."""
    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    n = 0
    for p in model.parameters():
        n += nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0)
    for state in opt.state.values():
        n += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return n


# -- spawning ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, program: Callable[..., Any], workdir: str,
               queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import warnings

    from autoprec.policy import PolicyWarning

    warnings.simplefilter("ignore", PolicyWarning)  # hand-written policy: no fingerprint
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:  # through a file: tensors sent on the queue would die with this process
        torch.save(program(rank, world, Path(workdir)), Path(workdir) / f"rank{rank}.pt")
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 — the parent re-raises it with the rank named
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(program: Callable[[int, int, Path], Any], workdir: Path,
              world: int = 2, timeout: float = 300.0) -> list[Any]:
    """``program(rank, world, workdir)`` on ``world`` gloo ranks; each rank's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, program, str(workdir), queue))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            raise RuntimeError(f"rank process {p.pid} still running after {timeout:g} s")
    done = []
    while not queue.empty():
        rank, err = queue.get()
        if err is not None:
            raise RuntimeError(f"rank {rank} failed:\n{err}")
        done.append(rank)
    if sorted(done) != list(range(world)):
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"ranks {sorted(done)} of {world} reported; exit codes {codes}")
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]
