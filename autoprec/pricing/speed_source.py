"""The profile a tune prices with: measured here when the target is this machine.

A remote target (``h100`` from a CPU machine) is priced on its stored datasheet profile:
estimated, and said so. A local one (``cpu``, or the CUDA device here when its name matches
the profile) is calibrated on this machine first: single GEMMs per precision, a copy and a
tiny add, run as autoprec runs them (``apply_policy``) and fitted with
``autoprec.cost.calibrate.fit`` — a couple of seconds, cached per machine under
``<cache>/calibration/<profile>-<machine key>.yaml`` with the facts that identify the
machine (CPU matmul flags such as AMX / AVX512-BF16, or GPU name and compute capability;
torch version; threads). Seen here: the shipped ``cpu`` profile (fitted on a CPU with AMX)
priced a bf16 policy 1.82x faster than fp32 on a CPU without AMX, where it measured 0.56x.

For ``torch.compile`` deployments (``mode="compile"``) the same micro-benchmarks run
compiled and the compiled call's own per-forward time (``measure.call_overhead``) is
fitted too: a second calibration, cached beside the first (``<profile>-compile-<key>``).
Compiling ~25 tiny programs takes one to two minutes on a 2-core CPU, once per machine.

On a CPU the model's own ops are timed too (``measure.op_times``: every distinct op in each
dtype a plan may run it in, the casts, a module call), cached per op set, batch and
machine beside the calibration; ``SpeedSource.cost_model`` is the one way a tune,
``eval`` and ``check`` get a cost model for a target, so the three print one price.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoprec.cost import apply_calibration, fit, get_profile
from autoprec.cost.profiles import DeviceProfile, calibration_from_dict
from autoprec.device.targets import is_cpu
from autoprec.measure import (
    CPU_SHAPES,
    Machine,
    cached_calibration,
    calibration_path,
    call_overhead,
    gpu_shapes,
    local_device,
    measure_latency,
    micro_samples,
    this_machine,
    timing_threads,
)
from autoprec.policy import Policy, PolicyWarning


@dataclass
class SpeedSource:
    """Where a tune's speed figures come from."""

    profile: DeviceProfile  # what the cost model prices with
    device: str | None  # the device here that runs the target; None: a remote target
    machine: Machine | None
    how: str  # "calibrated here" | "cached calibration" | "stored profile"
    note: str  # one line for the user
    path: Path | None = None  # the cached calibration file
    #: where op times are cached, and whether they may be measured now (else cached only)
    cache_dir: Path | None = None
    measure: bool = False
    #: op times got (per trace digest): what each cost model of this source priced with
    timed: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def local(self) -> bool:
        return self.device is not None

    def op_times(self, graph: Any, batch_size: int) -> Any:
        """The model's ops timed on this CPU at ``batch_size`` (``measure.op_times``), cached;
        None for a remote target, a GPU, or a stored profile (nothing measured here)."""
        from autoprec.measure import measure_op_times, timing_threads

        if (not self.local or not is_cpu(self.device) or self.how == "stored profile"
                or self.cache_dir is None or graph.ops is None):
            return None
        with timing_threads(self.device):
            got = measure_op_times(graph.ops, batch_size, self.cache_dir,
                                     machine=self.machine.key if self.machine else "",
                                     measure_now=self.measure,
                                     precisions=[p for p in ("bf16", "fp16")
                                                 if self.profile.supports(p)[0]])
        if got is not None:
            self.timed.setdefault(got.digest, got)  # the first: measured or read
        return got

    def cost_model(self, graph: Any, batch_size: int | None = None, mode: str = "eager",
                   form: str = "train", fp8_backend: str | None = None,
                   step: bool | None = None) -> Any:
        """The cost model of ``graph`` for this target: the profile, and on a local CPU the
        model's own ops timed here (``op_times``); ``step`` (default: the training form)
        prices the whole training step (``cost.step``), else the forward."""
        from autoprec.cost import make_cost_model

        bs = batch_size or graph.batch_size
        step = form == "train" if step is None else step
        times = self.op_times(graph, bs)
        extra = {}
        if (step and form == "train" and mode == "eager" and times is not None
                and self.cache_dir is not None):
            from autoprec.measure import (
                cached_or_measured_grads,
                cached_or_measured_optimizer,
                timing_threads,
            )

            with timing_threads(self.device):  # the step's gradient GEMMs timed here too
                extra["grad_times"] = cached_or_measured_grads(
                    graph.ops, bs, self.cache_dir, times.digest,
                    [p for p in ("bf16", "fp16") if self.profile.supports(p)[0]],
                    measure_now=self.measure)
                # the optimizer step as torch runs it on this device, timed here
                extra["optimizer_s"] = cached_or_measured_optimizer(
                    [v.numel for v in graph.ops.values
                     if v.source == "param" and v.trainable and v.param],
                    self.cache_dir, times.digest, measure_now=self.measure)
        return make_cost_model(graph, self.profile, bs, mode, form=form, op_times=times,
                               step=step, fp8_backend=fp8_backend, **extra)

    def describe_op_times(self) -> str | None:
        """One line on the op timings this source priced with (None: none)."""
        if not self.timed:
            return None
        return "; ".join(t.describe() for t in self.timed.values())

    def provenance(self) -> dict[str, Any]:
        """What the policy's provenance records about its speed figures."""
        out: dict[str, Any] = {"speed_profile": self.profile.name, "speed_source": self.how}
        if self.machine is not None:
            out["machine"] = self.machine.describe()
        if self.how == "stored profile":
            out["speed_note"] = (f"stored {self.profile.name} profile: "
                                 f"{self.profile.description}")
        return out


def calibration_dir(out: Path | None, cache_dir: Path | None = None) -> Path:
    """Where a tune writing ``out`` (default ``policies/…``) caches calibrations: beside the
    probe cache (``<out's folder>/.autoprec``, or ``cache_dir``)."""
    base = cache_dir if cache_dir is not None else (
        Path(out).parent if out is not None else Path("policies")) / ".autoprec"
    return Path(base) / "calibration"


def speed_source(target: str, *, measure: bool, cache_dir: Path,
                 mode: str = "eager") -> SpeedSource:
    """The profile for ``target`` deployed in ``mode``. Remote: the stored one. Local: this
    machine's cached calibration; else, with ``measure``, one calibrated here now (and
    cached); else the stored profile, named as another machine's."""
    src = _speed_source(target, measure=measure, cache_dir=cache_dir, mode=mode)
    src.cache_dir, src.measure = Path(cache_dir), measure
    return src


def _speed_source(target: str, *, measure: bool, cache_dir: Path, mode: str) -> SpeedSource:
    stored = get_profile(target)
    device, why = local_device(stored)
    if device is None:
        return SpeedSource(stored, None, None, "stored profile", why)
    machine = this_machine(device)
    path = calibration_path(cache_dir, stored, machine, mode)
    cal = cached_calibration(cache_dir, stored, machine, mode)
    compiled = " (compiled micro-benchmarks)" if mode == "compile" else ""
    if cal is not None:
        return SpeedSource(apply_calibration(stored, cal, source=str(path)), device, machine,
                           "cached calibration",
                           f"{stored.name} profile calibrated on this machine{compiled} "
                           f"({machine.describe()}); cached in {path}", path)
    if not measure:
        return SpeedSource(stored, device, machine, "stored profile",
                           f"speed estimated from the stored {stored.name} profile, measured "
                           f"on another machine ({stored.description}), not on this one "
                           f"({machine.describe()}); --measure calibrates it here")
    t0 = time.perf_counter()
    res = calibrate_here(stored, device, machine, mode=mode)
    res.calibration.save(path)
    # priced as the cache reads back (rounded factors): a later run, which reads the cache,
    # then prices alike and names its study alike (--resume joins this run's trials)
    cal = calibration_from_dict(res.calibration.to_dict(), str(path))
    return SpeedSource(apply_calibration(stored, cal, source=str(path)), device,
                       machine, "calibrated here",
                       f"calibrated the {stored.name} profile on this machine{compiled} "
                       f"({machine.describe()}): {res.calibration.n_samples} micro-benchmarks "
                       f"in {time.perf_counter() - t0:.1f}s, rel. RMSE "
                       f"{res.calibration.rel_rmse:.0%}; cached in {path}", path)


def calibrate_here(profile: DeviceProfile, device: str, machine: Machine | None = None, *,
                   mode: str = "eager") -> Any:
    """Fit ``profile``'s factors on micro-benchmarks run on ``device`` (a FitResult);
    ``mode="compile"``: the micro-benchmarks ``torch.compile``'d, and the compiled call's
    per-forward overhead measured and recorded (``Calibration.call_overhead_s``)."""
    import torch

    from autoprec.apply.apply import apply_policy
    from autoprec.device.capability import capability

    machine = machine or this_machine(device)
    plans = {p: Policy(default=p) for p in ("fp32", "tf32", "bf16", "fp16")
             if profile.supports(p)[0] and capability(p, None, device)[0]}
    fp8 = None
    if profile.supports("fp8")[0] and capability("fp8", "torch", device)[0]:
        fp8 = "torch"
        plans["fp8"] = Policy(default="bf16", layers={"gemm": "fp8"})

    def run_as(module: Any, pol: Policy) -> Any:
        return apply_policy(module, pol, target=profile.name, fp8_backend=fp8)

    if is_cpu(device):
        def timer(run: Any) -> float:
            return measure_latency(run, "cpu", warmup=2, repeats=5, clock="thread").median_s

        shapes, elems, fit_setup = CPU_SHAPES, None, True
    else:
        def timer(run: Any) -> float:
            return measure_latency(run, device, warmup=3, repeats=10).median_s

        shapes, elems, fit_setup = gpu_shapes(4096, 8192), 8192 * 4096, False
    compiled = mode == "compile"
    overhead = None
    with timing_threads(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # one-GEMM plans: no fingerprint
        kw = {} if elems is None else {"copy_elems": elems}
        if compiled:
            overhead = call_overhead(timer, device)
            kw.update(compile=True, call_overhead_s=overhead)
        samples = micro_samples(profile, plans, shapes, timer, run_as, device=device, **kw)
    res = fit(profile, samples, fit_setup=fit_setup,
              note=f"autoprec tune: {'compiled ' if compiled else ''}micro-benchmarks on "
                   f"{machine.describe()}, torch {torch.__version__}")
    res.calibration = dataclasses.replace(res.calibration, machine=machine.to_dict(),
                                          mode=mode, call_overhead_s=overhead)
    res.profile = apply_calibration(profile, res.calibration)
    return res


__all__ = ["SpeedSource", "calibrate_here", "calibration_dir", "speed_source"]
