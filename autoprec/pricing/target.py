"""The target a policy is priced, scored and timed for: resolved once, carried as one value.

``Target`` is the one thing every stage above the cost model is handed (tune's search and
confirmation, ``check``, ``eval``): what it runs as is decided here, by ``resolve_target``,
and read from it; no stage re-derives the device, the mode, the batch or the fp8 backend
from a string. Below it, ``autoprec.device.targets`` parses names, ``autoprec.device.capability``
answers what this machine runs and ``cost.profiles`` what a device has; they are the
facts this module decides from.

A target used to travel as a string (``"cpu"``, ``"h100"``) beside loose ``mode``,
``form``, ``fp8_backend`` and ``measure`` arguments, and every stage re-derived what it
needed: the fallback ``target or policy.target_device or DEFAULT_TARGET`` in ``check`` and
in ``eval``, the compile flag turned into a mode in each, the profile looked up again.
``check`` read the stored profile where ``eval`` read this machine's calibration: 2.59x
against 3.01x for one policy (issue 30). ``resolve_target`` decides all of it once:

- the **name**: given, else the policy's ``target.device`` (``targets.named_target``),
  else ``DEFAULT_TARGET``, in its one spelling; an unknown name is exit 2 here, before
  any work;
- the **mode**: ``torch.compile``'d or eager (given, else the policy's ``target.mode``);
- the **form**: how plans run, "deploy" (weights stored in their precision) or "train"
  (autocast over fp32 masters): given (tune's ``--form``), else the policy's;
- the **GEMM backend** of fp8 layers (``apply_policy``'s ``fp8_backend``; None: the best
  this device runs, ``capability.best_fp8_backend``, chosen where it is applied);
- the **batch size** plans are priced at (given, else the policy's; ``deploy_batch``:
  else the calibration batch's);
- the **capability**: what the target runs (``supports``: its profile's answer, the
  datasheet's; ``runs_here``: this machine's, for a local target);
- the **speed source** (``speed_source.SpeedSource``): the profile the cost model prices
  with and where it comes from, measured here for a local target, with the model's own
  ops timed on a local CPU; ``Target.plan_cost`` is the one way a price is made (the
  cost model, and a training step's loss where model.py has one).

``Target.apply`` and ``Target.audit`` are the one way a stage of tune, eval or check
applies and audits a policy for the target. The device type (whose autocast op lists a plan follows) is
``targets.device_type`` of the name: the plan replay, the cost model and apply ask it there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoprec.device.targets import DEFAULT_TARGET, device_type, named_target
from autoprec.pricing.speed_source import SpeedSource, calibration_dir, speed_source
from autoprec.workload.metrics import batch_size_of


def target_name(given: str | None, recorded: str | None = None) -> str:
    """The target a run is for, in its one spelling: ``given`` (``--target``), else
    ``recorded`` (a policy's ``target.device``), else ``DEFAULT_TARGET``."""
    return named_target(given, recorded) or DEFAULT_TARGET


def mode_of(compile: bool | None, default: str = "eager") -> str:
    """The deployment mode of a ``--compile`` flag: "compile", "eager", or ``default``
    when the flag is not given (None)."""
    if compile is None:
        return default
    return "compile" if compile else "eager"


@dataclass
class Target:
    """One target, resolved (``resolve_target``): its name, deployment mode and form, fp8
    backend, deployment batch size, speed source, and what it can run."""

    name: str  # canonical profile name: "h100", "cpu", ...
    mode: str  # "eager" | "compile"
    speed: SpeedSource
    named: bool = True  # False: nothing named it (the default was taken)
    form: str = "deploy"  # how the run's plans run (precisions.FORMS)
    fp8_backend: str | None = None  # fp8 layers' GEMM backend (None: the best here)
    batch_size: int | None = None  # the deployment batch (None: the calibration batch's)
    #: what a speed figure prices: the training step (forward + backward + optimizer) or the
    #: forward alone (``resolve_target``: the step for the train form, given or written)
    step: bool = False

    def deploy_batch(self, batch: Any, default: int = 1) -> int:
        """The batch size plans are priced at: the target's, else ``batch``'s (a
        calibration batch), else ``default``."""
        return self.batch_size or batch_size_of(batch) or default

    def supports(self, precision: str) -> tuple[bool, str]:
        """Whether the target device has ``precision`` (its profile, the datasheet's
        answer, wherever it runs): (ok, why not)."""
        return self.profile.supports(precision)

    def runs_here(self, precision: str) -> tuple[bool, str] | None:
        """This machine's answer for a local target (``autoprec.device.capability``: the device,
        torch and the backends here); None for a remote one."""
        if not self.local:
            return None
        from autoprec.device.capability import capability

        return capability(precision, self.fp8_backend, self.device)

    @property
    def profile(self) -> Any:
        return self.speed.profile

    @property
    def device_type(self) -> str:
        return device_type(self.name)

    @property
    def local(self) -> bool:
        return self.speed.local

    @property
    def device(self) -> str | None:
        """The device here that runs the target ("cpu", "cuda:N"); None: a remote target."""
        return self.speed.device

    @property
    def compile(self) -> bool:
        return self.mode == "compile"

    def cost_model(self, graph: Any, batch_size: int | None = None) -> Any:
        """The cost model of ``graph`` on this target, in its mode and form
        (``SpeedSource.cost_model``)."""
        backend = self.fp8_backend
        if backend is None and self.local and self.device is not None:
            from autoprec.device.capability import best_fp8_backend  # what apply will run here

            backend = best_fp8_backend(self.device, training=self.form == "train")[0]
        return self.speed.cost_model(graph, batch_size, self.mode, form=self.form,
                                     fp8_backend=backend, step=self.step)

    def plan_cost(self, graph: Any, batch_size: int | None, *, net: Any,
                  forward: Callable[[Any, Any], Any],
                  loss: Callable[[Any, Any], Any] | None, batch: Any,
                  profile: Any = None) -> Any:
        """The one price of tune, ``eval`` and ``check``: ``cost_model`` at ``batch_size``
        and, where it prices a training step and model.py has a ``loss``, that loss's
        forward and backward (``measure.record_loss`` on ``batch``, timed here where the
        model's ops are: ``StepPart.set_loss``). ``profile``: price by that profile alone
        (tests, experiments), in the target's mode and form."""
        if profile is not None:
            from autoprec.cost.model import make_cost_model

            cost = make_cost_model(graph, profile, batch_size, self.mode, form=self.form,
                                   step=self.step, fp8_backend=self.fp8_backend)
        else:
            cost = self.cost_model(graph, batch_size)
        if loss is not None and getattr(cost, "step", None) is not None:
            from autoprec.measure import record_loss, timing_threads

            with timing_threads(self.device or "cpu"):  # timed here where the ops are
                cost.step.set_loss(cost, record_loss(net, forward, loss, batch,
                                                     measure=cost.op_times is not None))
        return cost

    def apply(self, model: Any, policy: Any, *, force: bool = False) -> Any:
        """``policy`` applied to ``model`` as this target runs it (its autocast op lists,
        its fp8 backend; each policy keeps its own form): a removable ``PolicyHandle``."""
        from autoprec.apply.apply import apply_policy

        if getattr(model, "autoprec_stream", None) is not None:  # blocks load as they run
            from autoprec.apply.streamed import apply_streamed

            return apply_streamed(model, policy, lambda root, pol, opts: apply_policy(
                root, pol, target=self.name, fp8_backend=self.fp8_backend, force=True,
                options=opts), force=force, applied_as=(self.name, self.fp8_backend))
        return apply_policy(model, policy, target=self.name, fp8_backend=self.fp8_backend,
                            force=force)

    def audit(self, model: Any, policy: Any, run: Callable[[], Any], *,
              force: bool = False) -> Any:
        """The audit of ``policy`` applied as ``apply`` applies it, on one real forward
        (``run()``; ``apply.audit_policy``): an ``AuditReport`` whose ``errors`` name each
        rule that did not run. The one audit of tune's search and confirmation, ``eval``
        and ``check``."""
        from autoprec.apply.apply import audit_policy

        if getattr(model, "autoprec_stream", None) is not None:  # blocks load as they run
            from autoprec.apply.streamed import audit_streamed

            return audit_streamed(model, policy, run, lambda root, pol, call, opts: audit_policy(
                root, pol, call, fp8_backend=self.fp8_backend, force=True,
                target=self.name, options=opts), force=force)
        return audit_policy(model, policy, run, fp8_backend=self.fp8_backend, force=force,
                            target=self.name)


def resolve_target(given: str | None, policy: Any = None, *, compile: bool | None = None,
                   form: str | None = None, fp8_backend: str | None = None,
                   batch_size: int | None = None, measure: bool = False,
                   cache_dir: Path | None = None, policy_path: Path | None = None) -> Target:
    """The target of a run: ``given`` (``--target``), else ``policy``'s, else the default;
    the mode from ``compile``, else the policy's; the form from ``form``, else the
    policy's, else "deploy"; the training step is priced for the train form, except a
    policy file without ``form:`` (written before the deploy form, tuned for the forward:
    its recorded figures are the forward's); the batch size from ``batch_size``, else the policy's; the
    speed source cached in ``cache_dir`` (default: beside ``policy_path``, as tune caches
    it beside the policy it writes). ``measure``: a local target's calibration may be
    measured now (else cached only)."""
    recorded = policy.target_device if policy is not None else None
    name, named = target_name(given, recorded), named_target(given, recorded)
    # speed_source looks the profile up once: an unknown device is exit 2 there
    mode = mode_of(compile, policy.mode if policy is not None else "eager")
    cache = cache_dir if cache_dir is not None else calibration_dir(policy_path)
    resolved_form = form or (policy.form if policy is not None else "deploy")
    step = resolved_form == "train" and (form is not None or policy is None
                                         or getattr(policy, "form_written", True))
    return Target(name, mode, speed_source(name, measure=measure, cache_dir=cache, mode=mode),
                  named=named is not None, form=resolved_form, step=step,
                  fp8_backend=fp8_backend,
                  batch_size=batch_size or (policy.batch_size if policy is not None else None))


__all__ = ["Target", "mode_of", "resolve_target", "target_name"]
