"""torch.nn's fused inference paths, and the module calls torch.nn never makes.

A policy's rules live on module forwards (``apply`` wraps them), so a rule holds only where
the module's forward really runs. Two kinds of torch.nn code compute with a child's
weights without calling the child:

- **Fused inference paths.** In eval mode, with autograd off for the weights (``no_grad``,
  ``inference_mode``, or no parameter requiring grad) and no *CUDA* autocast (torch checks
  ``torch.is_autocast_enabled()``, CUDA's flag: CPU autocast does not turn them off),
  ``nn.TransformerEncoderLayer`` runs as one kernel (``torch._transformer_encoder_layer_fwd``
  reads ``linear1``/``linear2``/``self_attn``'s weights), ``nn.TransformerEncoder`` packs a
  padded batch into nested tensors, and ``nn.MultiheadAttention`` runs
  ``torch._native_multi_head_attention``. Measured here (torch 2.13, CPU): a policy with
  fp8 on every FFN Linear of a 3-layer encoder gave error 2.9e-7 under ``no_grad`` (no rule
  ran) and 0.022 with the modules called. torch has one switch for all of them,
  ``torch.backends.mha.set_fastpath_enabled``, process-wide: while a policy is applied to a
  model holding such modules, ``apply`` turns it off (``FASTPATH.acquire``), and every
  forward autoprec measures (trace, probes, reference, score, audit) runs with it off
  (``fused_paths_off``), so what is measured is what runs under the policy. Dynamo reads
  the switch while tracing, so a model compiled after ``apply`` keeps the module calls.
- **Never-called children.** ``nn.MultiheadAttention`` computes its output projection
  from ``out_proj.weight`` inside ``F.multi_head_attention_forward`` in every mode;
  ``out_proj.forward`` never runs (its class, ``NonDynamicallyQuantizableLinear``, exists
  only for this attribute). It is not a GEMM layer of its own: its GEMM belongs to the
  attention module, which takes fp32/tf32/bf16/fp16 like any region; a rule naming
  ``out_proj`` is refused with ``not_called_reason``.

What else bypasses a module call (a model's own code reading ``self.proj.weight``) is
found by the audit: an op that reads a GEMM layer's weight while that layer is not running.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: Modules whose forward may take a fused path that skips their children's forwards.
FUSED_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder, torch.nn.MultiheadAttention,
)

#: Fused aten ops -> what they bypass, for the audit's messages.
FUSED_OPS = {
    "_transformer_encoder_layer_fwd": "nn.TransformerEncoderLayer's fused inference path "
                                      "(torch._transformer_encoder_layer_fwd)",
    "_native_multi_head_attention": "nn.MultiheadAttention's fused inference path "
                                    "(torch._native_multi_head_attention)",
}


def not_called_reason(module: torch.nn.Module) -> str | None:
    """Why ``module``'s forward never runs inside its parent (None: it may run)."""
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return ("nn.MultiheadAttention computes out_proj's GEMM from its weight inside "
                "F.multi_head_attention_forward and never calls out_proj: its precision is "
                "the attention module's (put the rule there)")
    return None


def has_fused_paths(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a module whose forward may take a fused path."""
    return any(isinstance(m, FUSED_TYPES) for m in model.modules())


class _FastpathSwitch:
    """torch's process-wide fused-path flag, off while anyone holds it (reference counted).

    The value before the first ``acquire`` is restored by the last ``release``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved = True

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved = torch.backends.mha.get_fastpath_enabled()
                torch.backends.mha.set_fastpath_enabled(False)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0:
                torch.backends.mha.set_fastpath_enabled(self._saved)

    @property
    def held(self) -> bool:
        return self._holders > 0


FASTPATH = _FastpathSwitch()


@contextmanager
def fused_paths_off() -> Iterator[None]:
    """torch.nn's fused inference paths off inside the block (nests; restores the flag)."""
    FASTPATH.acquire()
    try:
        yield
    finally:
        FASTPATH.release()


__all__ = ["FASTPATH", "FUSED_OPS", "FUSED_TYPES", "fused_paths_off", "has_fused_paths",
           "not_called_reason"]
