"""The model's own ops timed on this machine: what a local CPU target is priced with.

A profile fitted on ~25 micro-benchmarks (``cost.calibrate``) prices every op by a roofline
of FLOPs and bytes. On a CPU that misses what the model runs besides its GEMMs — the
dispatch of every aten op and view, norms, softmax and activations that are no faster in
16 bits, the 16-bit GEMMs' own shapes (docs/cost_history.md). So for a local CPU target
the recorded forward
(``trace.ops``: every op with its recipe, ``Op.recipe``) is run here op by op:

- every distinct op (same function, shapes, strides, dtypes and arguments) once per
  precision it may run in: a GEMM / SDPA / conv with its floating operands in fp32, bf16
  and fp16 (what it computes in), every other op with its floating inputs in each dtype;
- every convolution once more per precision in channels-last layout (``compute_cl``), the
  layout inductor's CPU backend gives every convolution of a graph (``torch._inductor
  .graph.decide_layout_opt``: with oneDNN, always);
- every cast a plan may insert: each floating value's size, fp32 <-> bf16 <-> fp16;
- the host's cost of one module call (``nn.Module.__call__`` around a trivial forward),
  paid by every plan once per recorded call, and of apply's wrapper around one (per form),
  paid per call of a module the plan wraps.

Each is timed as tune times a model (``evaluation.timing``): one torch thread, the thread's CPU
time, the median of ``SAMPLES`` samples of at least ``SAMPLE_S`` each, after a warm-up.
Inputs are rebuilt from the recipe (``uniform_`` values, integer tensors zero, boolean
ones true: a mask that attends everywhere). An op timed alone finds its weight in the
core's L2 cache, where the model's forward finds a stored weight only after moving every
other weight and activation since its last read: where that footprint overflows L2, the
weight operands are cycled through copies spanning it (``op_runner._span``, at most twice
the last-level cache). The training form's 16-bit GEMM, which reads the per-call cast of its master
weight just written, is priced at the same timing: end to end that fits the measured
forward where a hot timing did not (``op_measure.measure`` has the figures). A master weight's per-call cast is cycled through copies spanning the
same footprint (``op_measure._cast_times``). A parameter is rebuilt requiring grad, as
in the model: torch's matmul chooses its kernel by it (``op_runner._Builder.tensor``).

The result (``OpTimes``) is cached per op set, batch size and machine under
``<calibration dir>/ops-<digest>.json``: the first tune of a model pays seconds
(benchmarks/estimate_accuracy.py states it), later ones read the file. An op without a
recipe, or whose recipe cannot run alone, is priced by the calibrated roofline as before.
The batch: recipes are recorded at the calibration batch; a cost model at another batch
size rebuilds each tensor that scales with the batch with its leading dimension scaled
(an op that then fails is timed at the recorded batch and scaled linearly).

The parts live beside this module, which caches the result (``digest``,
``measure_op_times``): ``op_times_record`` (``OpTimes``, what is cached), ``measure.ops``
(what is timed: ``measure``) and ``op_runner`` (how one op is timed alone: ``SAMPLES``,
``SAMPLE_S``, ``_span``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from autoprec.cost.op_times_record import VERSION, OpTimes, cast_key
from autoprec.io.fileio import atomic_write
from autoprec.measure.op_runner import _key
from autoprec.measure.ops import DTYPES, is_conv, measure
from autoprec.trace.ops import OpTrace


def digest(trace: OpTrace, batch_size: int, machine: str) -> str:
    """What identifies one measurement: the recipes, the batch, the machine, torch."""
    h = hashlib.sha256()
    for op in trace.ops:
        h.update((_key(op.recipe, trace) if op.recipe else op.kind).encode())
    h.update(f"{batch_size}|{trace.batch_size}|{machine}|{torch.__version__}|{VERSION}"
             f"|{os.environ.get('ATEN_CPU_CAPABILITY', '')}".encode())
    return h.hexdigest()[:16]


def measure_op_times(trace: OpTrace, batch_size: int, cache_dir: Path, *, machine: str,
                       measure_now: bool, precisions: Iterable[str] = DTYPES,
                       progress: Callable[[int, int], None] | None = None
                       ) -> OpTimes | None:
    """The cached op times of this trace at ``batch_size`` on this machine; else, with
    ``measure_now``, measured and cached (atomically); else None."""
    d = digest(trace, batch_size, machine)
    path = Path(cache_dir) / f"ops-{d}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == VERSION and data.get("digest") == d:
                got = OpTimes.from_json(data)
                got.cached = True
                return got
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache file: measured again
    if not measure_now:
        return None
    got = measure(trace, batch_size, precisions=precisions, machine=machine,
                  progress=progress)
    got.digest = d
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(got.to_json()))
    return got


__all__ = ["OpTimes", "measure_op_times", "cast_key", "digest", "is_conv", "measure"]
