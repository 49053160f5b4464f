"""The loss of a training step, priced from the ops it really runs: model.py's ``loss``
forward and backward on the model's output.

The recorded forward (``trace``) ends at the model's output; a training step goes on with
``loss(outputs, batch)`` and its backward — for a cross-entropy: the output's cast to fp32
where it arrives 16-bit (``outputs.float()``), ``log_softmax`` (read the logits, write their
log-probabilities), ``nll_loss`` (gather one per row), then ``nll_loss_backward`` (a zeroed
gradient of the logits' size, one value scattered per row), ``log_softmax_backward`` (read
that and the saved log-probabilities, write the logits' gradient) and the cast back. The
logits of a language model are the largest activation of the step (GPT-2's 8 x 128 tokens
x 50 k vocabulary: 200 MB in fp32), so these passes are not small.

``autoprec.measure.record_loss(net, forward, loss, batch)`` runs the loss once per dtype the model's output
may arrive in (fp32, bf16, fp16), on a leaf tensor holding the real output in that dtype,
and keeps every kernel it launched forward and backward (``LossKernels``: aten ops other
than views, with the bytes each reads and writes). With ``measure`` (a local CPU target) it
also times that loss forward + backward here, per dtype, as ``cost.op_times`` times an op
(one thread, thread CPU time, the median of interleaved passes). ``StepPart.set_loss``
prices a plan's loss at the dtype the plan's replay gives the output: the timing where
there is one, else each kernel's roofline (``bytes / bandwidth + launch``); both scaled
linearly from the recorded batch to the priced one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from autoprec.plan.dtype_codes import DTYPES
from autoprec.trace.ops import OpTrace

#: The dtypes a model's output may arrive in (the plan stage's names).
OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LossKernel:
    """One kernel of the loss: its aten op, forward or backward, bytes read and written."""

    name: str
    phase: str  # "forward" | "backward"
    bytes: float


@dataclass
class LossKernels:
    """The loss's kernels per output dtype, and its measured seconds where timed here."""

    numel: int  # elements of the model's output the loss reads (at the recorded batch)
    kernels: dict[str, list[LossKernel]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # forward + backward, timed
    #: bytes the loss's autograd nodes save for its backward (log_softmax's result, ...),
    #: per output dtype, the model's output itself not counted
    saved: dict[str, float] = field(default_factory=dict)

    def table(self, bandwidth: float, launch: float) -> np.ndarray:
        """Seconds of the loss (forward + backward) by dtype code (``plan.dtype_codes``):
        measured where timed, else the roofline of its kernels; NaN for a dtype not run."""
        out = np.full(len(DTYPES), math.nan)
        for d, ks in self.kernels.items():
            out[DTYPES.index(d)] = self.seconds.get(
                d, sum(k.bytes / bandwidth + launch for k in ks))
        return out


def output_value(trace: OpTrace, numel: int) -> int | None:
    """The value id of the model's output the loss reads: among the outermost call's
    outputs, the floating one of ``numel`` elements (the last such op output otherwise)."""
    vals = trace.values
    outer = [c for c in trace.calls if c.module == 0] or trace.calls[:1]
    for c in reversed(outer):
        for v in reversed(c.outputs):
            if vals[v].numel == numel and vals[v].dtype in OUTPUT_DTYPES:
                return v
    for op in reversed(trace.ops):
        for v in op.outputs:
            if vals[v].numel == numel and vals[v].dtype in OUTPUT_DTYPES:
                return v
    return None


__all__ = ["LossKernel", "LossKernels", "OUTPUT_DTYPES", "output_value"]
