"""Running ops on this machine: the timings the cost stage's pricing and the evaluation read.

The one interface the rest of autoprec uses (submodules are this package's own):

- ``measure_latency(run)`` / ``measure_interleaved(runs)``: seconds of callables, CUDA
  events on a GPU, the thread's CPU time on a CPU (``latency``);
- ``measure_op_times(trace, batch_size, cache_dir, ...)``: the model's own recorded ops
  timed here per dtype, cached per machine (``op_times``; ``OpTimes`` is the cost stage's
  record of them);
- ``training_step(net, forward, loss, batch)``: a callable running one real training step
  (forward, loss, backward, AdamW, a GradScaler where fp16 runs), and its memory
  (``step_peak_bytes``, ``live_bytes``) (``train_steps``);
- ``this_machine()`` and ``local_device(profile)``: which machine this is, whether a
  profile's device is at hand, and the calibration cached for it (``machine``);
- ``micro_samples(...)`` / ``call_overhead(timer)``: the micro-benchmarks that
  ``cost.calibrate.fit`` fits a profile to (``micro``).

The cost stage never imports this package: it prices what it is handed (``OpTimes``, a
fitted profile).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec.io.lazy import lazy_exports

#: public name -> the submodule that holds it, imported on first use (torch is heavy).
_EXPORTS = {
    "Samples": "latency", "Timing": "latency", "allocator_trim": "latency",
    "measure_interleaved": "latency", "measure_latency": "latency",
    "measure_op_times": "op_times",
    "live_bytes": "train_steps", "step_peak_bytes": "train_steps",
    "training_step": "train_steps", "uses_fp16": "train_steps",
    "CPU_THREADS": "machine", "Machine": "machine", "cached_calibration": "machine",
    "calibration_path": "machine", "local_device": "machine", "this_machine": "machine",
    "timing_threads": "machine",
    "CPU_SHAPES": "micro", "call_overhead": "micro", "gpu_shapes": "micro",
    "micro_samples": "micro",
    "record_loss": "loss", "cached_or_measured_grads": "grad_times",
    "measure_grads": "grad_times",
    "cached_or_measured_optimizer": "optimizer_time", "measure_optimizer": "optimizer_time",
}

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.measure.grad_times import cached_or_measured_grads, measure_grads
    from autoprec.measure.latency import (
        Samples,
        Timing,
        allocator_trim,
        measure_interleaved,
        measure_latency,
    )
    from autoprec.measure.loss import record_loss
    from autoprec.measure.machine import (
        CPU_THREADS,
        Machine,
        cached_calibration,
        calibration_path,
        local_device,
        this_machine,
        timing_threads,
    )
    from autoprec.measure.micro import CPU_SHAPES, call_overhead, gpu_shapes, micro_samples
    from autoprec.measure.op_times import measure_op_times
    from autoprec.measure.optimizer_time import cached_or_measured_optimizer, measure_optimizer
    from autoprec.measure.train_steps import (
        live_bytes,
        step_peak_bytes,
        training_step,
        uses_fp16,
    )


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)


__all__ = [
    "CPU_SHAPES",
    "CPU_THREADS",
    "Machine",
    "Samples",
    "Timing",
    "allocator_trim",
    "cached_calibration",
    "calibration_path",
    "cached_or_measured_grads",
    "call_overhead",
    "gpu_shapes",
    "live_bytes",
    "local_device",
    "measure_interleaved",
    "measure_grads",
    "cached_or_measured_optimizer",
    "measure_optimizer",
    "measure_latency",
    "measure_op_times",
    "micro_samples",
    "record_loss",
    "step_peak_bytes",
    "this_machine",
    "timing_threads",
    "training_step",
    "uses_fp16",
]
