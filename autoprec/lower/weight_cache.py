"""When a quantised weight cached on a module may be reused.

``fp8._weight_fp8``, ``blockscale._weight_cache`` and ``nvfp4_train._weight_2d`` key their cache on the weight's
storage address and version counter: an optimizer step bumps the version, so the next
call re-quantises. Sharded data-parallel engines write new values into the same storage
*without* bumping it: FSDP2 (``fully_shard``) all-gathers each step's weights into the one
unsharded Parameter it keeps per weight, under ``torch.autograd._unsafe_preserve_version_
counter`` (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``), and FSDP1 /
ZeRO-3 reuse their gather buffers the same way. A cached weight would then be the first
step's for the whole run: an fp8 layer trained on stale weights with no error. Under
``torch.distributed`` the weight is therefore quantised at every call (the cost of one
cast per GEMM call, which training pays at every step anyway).
"""

from __future__ import annotations

import torch


def weight_cache_allowed() -> bool:
    """False under ``torch.distributed`` (a process group is initialised): a sharded
    engine may rewrite a weight in place without moving its version (module doc)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


__all__ = ["weight_cache_allowed"]
