"""Install a policy on a model: the plan's wrappers on module forwards, removable, audited.

``plan.compile`` decides every module's region and precision and which modules get a
wrapper (a module whose precision differs from the region it is called from, and the
root); ``lower.forward.lowered_forward`` enters the region in a ``with`` block. Leaving a wrapped
module, its 16-bit outputs are cast to fp32 only when the caller's region is fp32/tf32
(autocast off there): an autocast caller casts at the consumers that need it, as one
global autocast would. ``plan.schedule`` replays the same rules over a recorded forward,
so the cost model prices what this installs, and ``audit`` checks a real forward.

The target: a policy tuned for a CUDA device and applied on a CPU (to measure accuracy)
runs the ops CUDA autocast keeps in fp32 in fp32 (``lower.forward``'s ``emulate_cuda``).

Two forms (``precisions.FORMS``; the policy's ``form``, or ``apply_policy(form=...)``):

- ``train``: weights are never cast in place: autocast casts them (its cast cache on
  where the plan has one 16-bit dtype, as one global autocast; off where it has two, so
  a tied weight or a module called twice in two dtypes gets the right cast each time) and the fp8 backend quantises a copy; the fp32 masters, their
  storage and their gradients stay.
- ``deploy``: each module's tensors are stored once in its precision (``apply.stored``)
  and the wrappers run without autocast (``lower.stored``): what ``model.to(bf16)``
  runs, region by region. ``remove()`` puts the fp32 masters back.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.apply.after_apply import AfterApply
from autoprec.apply.audit import AuditReport, audit_run, notify_compute
from autoprec.apply.compiled import audit_compiled
from autoprec.apply.consumers import RerunCasts, consumer_wrappers, consumers, one_storage_dtype
from autoprec.apply.guard import Guard, GuardCounts, GuardEvent, select_layers, stored_masters
from autoprec.apply.stored import StoredWeights, model_bytes, store_weights
from autoprec.device.capability import capability
from autoprec.device.targets import device_type, named_target
from autoprec.errors import CapabilityError, InputError, warn
from autoprec.formats.precisions import (
    AUTOCAST_DTYPES,
    FORMS,
    PRECISIONS,
    is_gemm_format,
)
from autoprec.fused import FASTPATH, has_fused_paths
from autoprec.io.paths import unwrap_model
from autoprec.lower.backends import format_backends
from autoprec.lower.forward import lowered_forward
from autoprec.lower.fp8 import drop_weight_caches
from autoprec.lower.stored import deploy_forward
from autoprec.lower.wide16 import scoring_gemms
from autoprec.plan.compile import ExecutionPlan, Wrapped, compile_plan
from autoprec.policy.guard_spec import GuardSpec, parse_guard
from autoprec.policy.modules import Resolved, gemm_leaf_paths, module_table
from autoprec.policy.schema import Policy

_LOW = (torch.float16, torch.bfloat16)
_MISSING = object()
#: Every module under an active policy, with its handle: a second policy on the model, a
#: submodule or a parent of it is refused (nested wrappers would fight over the forwards).
_UNDER_POLICY: weakref.WeakKeyDictionary[torch.nn.Module, PolicyHandle] = (
    weakref.WeakKeyDictionary())


def _cast_out(obj: Any) -> Any:
    """16-bit outputs to fp32 when the caller's region is fp32/tf32 (autocast off)."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in _LOW or torch.is_autocast_enabled(obj.device.type):
            return obj
        return obj.float()
    if isinstance(obj, tuple):
        items = [_cast_out(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)._make(items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_cast_out(v) for v in obj]
    if isinstance(obj, Mapping) and hasattr(obj, "__setitem__"):
        # dicts and HF ModelOutput (an OrderedDict dataclass): a shallow copy keeps the
        # type and its non-tensor members (a KV cache object) untouched.
        # a loop, not a comprehension with ``:=``: dynamo graph-breaks on its cell
        changed: dict[Any, Any] = {}
        for k, v in obj.items():
            c = _cast_out(v)
            if c is not v:
                changed[k] = c
        if not changed:
            return obj
        out = copy.copy(obj)
        for k, v in changed.items():
            out[k] = v
        return out
    return obj


def _wrapper(module: torch.nn.Module, precision: str, fp8_backend: str,
             on_compute: Callable[[str], None] | None, cast_exit: bool,
             emulate_cuda: bool, cast_cache: bool) -> Callable[..., Any]:
    inner = lowered_forward(module, precision, fp8_backend=fp8_backend, on_compute=on_compute,
                            emulate_cuda=emulate_cuda, cast_cache=cast_cache)
    if not cast_exit:
        fwd = inner
    else:
        @functools.wraps(inner)
        def fwd(*args: Any, **kwargs: Any) -> Any:
            return _cast_out(inner(*args, **kwargs))
    return fwd


def _bound_to(module: torch.nn.Module, fwd: Callable[..., Any], old: Any) -> Any:
    """``fwd`` installed as a method bound to ``module``.

    ``copy.deepcopy`` of a model under a policy (EMA, checkpoint averaging) rebinds a
    bound method to the copied module: the copy then runs its *own* forward, with no
    policy — never the original's wrapped forward, which would compute with the original's
    weights. The copy is a plain model (apply a policy to it if wanted); the original keeps
    its policy and its handle. A user's own instance forward (``old``) is rebound to the
    copy when it is a method, else the class's forward runs."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is module:
            return fwd(*args, **kwargs)
        if isinstance(old, types.MethodType):
            return old.__func__(self, *args, **kwargs)
        return type(self).forward(self, *args, **kwargs)

    functools.update_wrapper(forward, fwd)
    try:  # the bound method shows the module's own signature (HF Trainer reads it)
        sig = inspect.signature(fwd)
        forward.__signature__ = sig.replace(parameters=[  # type: ignore[attr-defined]
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
            *sig.parameters.values()])
    except (TypeError, ValueError):
        pass
    return types.MethodType(forward, module)


class PolicyHandle:
    """A policy installed on a model. ``remove()`` restores the original forwards exactly.

    Also a context manager: ``with apply_policy(model, policy): ...`` removes on exit.
    """

    def __init__(self, model: torch.nn.Module, policy: Policy, plan: ExecutionPlan,
                 layers: dict[str, Resolved], wrapped: list[Wrapped], fp8_backend: str | None,
                 fp8_reason: str, device: torch.device, target_device_type: str) -> None:
        self.model = model
        self.policy = policy
        self.plan = plan
        self.target_device_type = target_device_type  # whose autocast lists run here
        self.layers = layers  # resolution of every module path
        self.wrapped = wrapped
        self.fp8_backend = fp8_backend  # None when no layer computes in fp8
        self.fp8_reason = fp8_reason
        #: the backend each GEMM format of the plan runs on (fp8, mxfp8, nvfp4)
        self.format_backends: dict[str, str] = {}
        self.device = device
        self._saved: list[tuple[weakref.ref[torch.nn.Module], Any]] = []
        self._fastpath_held = False  # this handle holds torch.nn's fused paths off
        self.form = "train"
        self.stored: StoredWeights | None = None  # the deploy form's stored tensors
        self.guard: Guard | None = None  # the run-time check (apply.guard); None: off
        self._after: AfterApply | None = None  # refusals after apply (apply.after_apply)

    def guard_stats(self) -> dict[str, GuardCounts]:
        """Per guarded layer: forward calls checked, forwards whose output was not finite,
        forwards recovered with it raised (``apply.guard``); empty when the guard is off."""
        return {} if self.guard is None else self.guard.stats()

    def weight_bytes(self) -> int:
        """Bytes of the parameters and buffers the model holds now (a tied tensor once):
        under the deploy form, the deployed weights (the masters are the handle's)."""
        return model_bytes(unwrap_model(self.model))

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def _install(self, modules: list[tuple[torch.nn.Module, Callable[..., Any]]]) -> None:
        root = unwrap_model(self.model)
        for mod in root.modules():
            _UNDER_POLICY[mod] = self
        if has_fused_paths(root):
            # The fused inference paths of nn.TransformerEncoderLayer / MultiheadAttention
            # compute with their children's weights without calling them: the children's
            # rules would not run (autoprec/fused.py). Off while the policy is applied.
            FASTPATH.acquire()
            self._fastpath_held = True
        try:
            for mod, fwd in modules:
                # An instance-level forward (set by the user or another library) is kept
                # as is and put back; otherwise the class method shows through again.
                old = mod.__dict__.get("forward", _MISSING)
                self._saved.append((weakref.ref(mod), old))
                mod.forward = _bound_to(mod, fwd, old)  # type: ignore[method-assign]
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Restore every wrapped module's original forward (idempotent)."""
        for mod in unwrap_model(self.model).modules():
            if _UNDER_POLICY.get(mod) is self:
                del _UNDER_POLICY[mod]
        if self._fastpath_held:
            self._fastpath_held = False
            FASTPATH.release()
        while self._saved:
            ref, old = self._saved.pop()
            mod = ref()
            if mod is None:
                continue
            if old is _MISSING:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = old  # type: ignore[method-assign]
        if self._after is not None:
            self._after.remove()
        if self.stored is not None:
            self.stored.restore()
        # the quantised weights this plan's fp8 / block-scaled leaves cached go with it
        drop_weight_caches(unwrap_model(self.model))

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def assignment(self) -> dict[str, str]:
        """``{gemm_leaf_path: precision}`` under the installed policy (for the cost model)."""
        return self.plan.assignment(gemm_leaf_paths(self.model))

    def audit(self, run: Callable[[], Any], strict: bool = True) -> AuditReport:
        """Run ``run()`` (a real forward) and report what every GEMM computed in.

        ``strict``: raise AuditError when a GEMM did not compute in its rule's precision.
        """
        if not self.active:
            raise InputError("audit: this policy handle was removed; apply the policy again")
        return audit_run(self.model, self.layers, self.policy, run, strict=strict)

    def audit_compiled(self, call: Callable[[torch.nn.Module], Any],
                       strict: bool = True) -> AuditReport:
        """Compile the applied model, run ``call(compiled_model)`` (a real forward) and
        check the GEMMs of the compiled graph against the plan (``apply/compiled.py``).

        The deployment snippet is ``apply_policy`` then ``torch.compile``; this proves the
        graph torch.compile builds keeps every rule. ``strict``: raise AuditError.
        """
        if not self.active:
            raise InputError("audit: this policy handle was removed; apply the policy again")
        report = audit_compiled(self.model, self.layers, call)
        if strict:
            report.raise_for_errors()
        return report

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        guard = "" if self.guard is None else (f", guard {self.guard.mode} on "
                                               f"{len(self.guard.layers)} layers")
        return (f"PolicyHandle({self.policy.source}, {self.form} form, "
                f"{len(self.wrapped)} wrappers, fp8={self.fp8_backend}{guard}, {state})")


def _model_device(root: torch.nn.Module) -> torch.device:
    for t in root.parameters():
        return t.device
    for t in root.buffers():
        return t.device
    return torch.device("cpu")


def target_device_type(target: str | None, device: torch.device) -> str:
    """Whose autocast op lists the plan follows: the target's (a device profile name such
    as "h100", or a device type; ``targets.named_target``), else the device it runs on."""
    if target is None:
        return device.type
    return device_type(target)


def _target_runs(name: str | None) -> Callable[[str], bool]:
    """Whether the plan's target device profile has a precision (a guard's fallback must
    run there too); any precision when the target is no profile ("cpu", "cuda", none)."""
    from autoprec.cost import get_profile

    if name is None:
        return lambda p: True
    try:
        profile = get_profile(name)
    except InputError:
        return lambda p: True
    return lambda p: profile.supports(p)[0]


def _check_apply_args(model: Any, policy: Any) -> Policy:
    """The documented errors for wrong argument types, before anything is touched."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"apply_policy: model must be a torch.nn.Module, got "
                         f"{type(model).__name__}")
    if isinstance(unwrap_model(model), torch.jit.ScriptModule):
        raise InputError("apply_policy: model is a TorchScript module; apply the policy to "
                         "the eager nn.Module (before torch.jit.script / trace)")
    if isinstance(policy, (str, Path)):
        from autoprec.policy.schema import load_policy

        return load_policy(policy)
    if not isinstance(policy, Policy):
        hint = (" (Policy.from_dict(d) builds one from a mapping)"
                if isinstance(policy, Mapping) else "")
        raise InputError(f"apply_policy: policy must be a Policy or the path of a policy file, "
                         f"got {type(policy).__name__}{hint}")
    return policy


@dataclass(frozen=True)
class ApplyOptions:
    """``apply_policy``'s rarely needed settings.

    ``device``: where the model runs (default: its parameters'). ``keep_masters`` (deploy
    form): the handle keeps the fp32 masters (in host memory when the model is on an
    accelerator) and ``remove()`` restores them exactly; False frees them, and ``remove()``
    restores fp32 weights rebuilt from the deployed values (with a warning). ``on_event``:
    called with a GuardEvent for each layer that overflowed in a forward (``guard``).
    ``whole_plan``: the plan of the whole model when this installs a part of it (a streamed
    model's shell, ``apply.streamed``): the choices that depend on every region (one
    storage dtype, one autocast dtype) are the whole plan's.
    """

    device: str | torch.device | None = None
    keep_masters: bool = True
    on_event: Callable[[GuardEvent], None] | None = None
    whole_plan: ExecutionPlan | None = None


def apply_policy(model: torch.nn.Module, policy: Policy | str | Path, *,
                 target: str | None = None, form: str | None = None,
                 guard: str | GuardSpec | Mapping[str, Any] | None = None,
                 fp8_backend: str | None = None, force: bool = False,
                 options: ApplyOptions | None = None) -> PolicyHandle:
    """Install ``policy`` on ``model`` (compiled/DDP wrappers are looked through).

    ``fp8_backend``: the backend of the fp8 layers, emulated / torch / te / torchao /
    torchao-rowwise (torchao's float8 training: train form only); default: the best this
    device runs (``best_fp8_backend``; the train form prefers torchao's float8 training
    to the home-made torch backend where its kernels run). The other GEMM formats (mxfp8, nvfp4) take no
    choice: torch's block-scaled kernels where ``blockscale_capability`` says they run, else
    emulation.
    ``target``: the device the plan is for (a profile name like "h100", or "cuda"/"cpu";
    default: the policy's ``target``, else ``device``): on a CPU, a CUDA target's autocast
    op lists are followed. ``force`` applies a policy whose fingerprint does not match,
    with a warning.
    ``policy`` may also be a path to a policy file (read with ``load_policy``).
    ``form``: "deploy" (weights stored in each layer's precision, no autocast) or "train"
    (autocast over fp32 masters); default: the policy's ``form``.
    ``guard``: the run-time overflow check (``apply.guard``; a mode "off" / "detect" /
    "fallback" / "raise", or the policy key's mapping); default: the policy's ``guard``.
    ``options``: the rarely needed settings (``ApplyOptions``: device, keep_masters,
    on_event).
    Raises PolicyError (does not validate), CapabilityError (a precision or backend cannot
    run here, with the reason) or InputError (a policy is already applied; ``model`` is not
    an nn.Module, or a TorchScript one; ``policy`` is neither a Policy nor a path); the
    model is untouched when anything is raised.
    """
    policy = _check_apply_args(model, policy)
    opts = options if options is not None else ApplyOptions()
    device, keep_masters, on_event = opts.device, opts.keep_masters, opts.on_event
    form = policy.form if form is None else form
    if form not in FORMS:
        raise InputError(f"apply_policy: form must be one of {', '.join(FORMS)}, got {form!r}")
    root = unwrap_model(model)
    for path, mod in root.named_modules():
        if mod in _UNDER_POLICY:
            raise InputError(f"a policy is already applied to this model (module "
                             f"{path or '<root>'!r} is under {_UNDER_POLICY[mod]!r}); "
                             "remove that handle first")
    policy.validate(root, force=force)  # the rules against the model's structure
    dev = torch.device(device) if device is not None else _model_device(root)
    plan = compile_plan(policy, root)  # the one resolution: everything below reads it
    plan.warn_unreached()
    table = module_table(root)
    res = plan.resolution()  # a shared module: one precision under every alias
    modules = dict(root.named_modules())
    chosen = [(modules[w.path] if w.path in modules else table[w.path], w)
              for w in plan.wrappers()]
    # the target named (here, else the policy's): the one order targets.named_target keeps
    target = named_target(target, policy.target_device)
    target_type = target_device_type(target, dev)
    emulate = target_type == "cuda" and dev.type != "cuda"

    spec = policy.guard if guard is None else parse_guard("apply_policy(guard=...)", guard)
    guarded = []
    if spec.on:
        if spec.mode == "fallback" and form != "deploy":
            raise InputError(f"{policy.source}: guard: fallback re-runs layers from their "
                             f"deployed weights and needs the deploy form, not {form!r}; use "
                             "detect or raise")
        guarded = select_layers(spec, gemm_leaf_paths(root), {**table, **modules}, res,
                                policy.reasons, dev,
                                policy.source if guard is None else "apply_policy(guard=...)",
                                _target_runs(target))
        if not guarded:
            warn(f"{policy.source}: guard {spec.mode}: no layer to check (no GEMM layer "
                 "computes in a small-range format; guard.layers: all checks every one)")

    used = {w.precision for _, w in chosen}
    format_backend, backend, fp8_reason = format_backends(used, fp8_backend, dev,
                                                         training=form == "train")
    for prec in sorted(used):
        ok, why = capability(prec, format_backend.get(prec), dev)
        if not ok:
            w = next(w for _, w in chosen if w.precision == prec)
            key = "default" if w.rule is None else f"layers[{w.rule!r}]"
            raise CapabilityError(f"{policy.source}: {key}: {prec} cannot run on {dev}: {why}")

    stored = None
    rerun_casts = RerunCasts([])  # the guard's re-run casts (apply.consumers)
    if form == "deploy":
        index = plan.tree.index()
        wrappers = [(mod, deploy_forward(
            mod, w.precision, format_backend.get(w.precision, "emulated"),
            notify_compute if is_gemm_format(w.precision) else None,
            leaf_region=PRECISIONS[int(plan.region[index[w.path]])])) for mod, w in chosen]
        # the plan's paths -> modules (a shared module under its first path)
        by_path = {p: modules[p] if p in modules else table[p] for p in plan.tree.paths
                   if p in modules or p in table}
        # modules with weights (or norms) inside a region read inputs of another dtype
        # by their own rule (apply.consumers); where every region stores one dtype,
        # nothing the plan makes arrives in another (the root casts the inputs): the
        # rules then run only in a guard's re-run, which raises layers to another dtype
        pairs = consumers(plan, by_path, {id(mod) for mod, _ in chosen})
        single = one_storage_dtype(opts.whole_plan or plan)
        rerun_casts = RerunCasts(pairs if single else [])
        if not single:
            wrappers += consumer_wrappers(pairs)
        stored = store_weights(root, plan, by_path, format_backend, keep_masters)
    else:
        # one 16-bit autocast dtype in the whole plan: autocast's cast cache is safe (and
        # the fast path, lower.forward.lowered_forward)
        low = {PRECISIONS[int(r)] for r in (opts.whole_plan or plan).region} & set(AUTOCAST_DTYPES)
        wrappers = [(mod, _wrapper(mod, w.precision, format_backend.get(w.precision, "emulated"),
                                   notify_compute if is_gemm_format(w.precision) else None,
                                   cast_exit=w.path != "", emulate_cuda=emulate,
                                   cast_cache=len(low) <= 1))
                    for mod, w in chosen]
    handle = PolicyHandle(model, policy, plan, res, [w for _, w in chosen], backend,
                          fp8_reason, dev, target_type)
    handle.form = form
    handle.format_backends = {f: b for f, b in format_backend.items() if f in used}
    handle.stored = stored
    if guarded:
        handle.guard = Guard(spec, guarded, form,
                             stored_masters(stored.slots if stored is not None else []),
                             on_event, policy.source, rerun_casts)
        wrappers = handle.guard.wrap(wrappers, root)
    try:
        handle._install(wrappers)
        # a backward into the deployed copies, and a dtype change, refused (apply.after_apply)
        handle._after = AfterApply(root, policy.source, form)
        if stored is not None:
            handle._after.refuse_backward(stored.copies())
        handle._after.guard_conversions()
    except BaseException:
        handle.remove()
        if stored is not None:
            stored.restore()
        raise
    return handle





def audit_policy(model: torch.nn.Module, policy: Policy, run: Callable[[], Any], *,
                 fp8_backend: str | None = None, force: bool = False,
                 target: str | None = None, options: ApplyOptions | None = None
                 ) -> AuditReport:
    """The audit of ``policy`` on one real forward: applied to ``model``, ``run()`` under
    ``no_grad`` (the handle holds torch.nn's fused paths off), removed again.

    Not strict: the report's ``errors`` say which rule did not run. The one audit of a
    plan that tune's search, tune's confirmation, ``check`` and ``eval`` all use; the
    report also carries what was installed (``layers``, ``fp8_backend``).
    """
    # 16-bit GEMMs this CPU has no kernel for run wide (lower/wide16), below the audit's
    # recorder: it still sees each GEMM's 16-bit operands first
    with scoring_gemms(), apply_policy(model, policy, fp8_backend=fp8_backend, force=force,
                                       target=target, options=options) as handle, \
            torch.no_grad():
        report = handle.audit(run, strict=False)
    report.layers, report.fp8_backend = dict(handle.layers), handle.fp8_backend
    return report


__all__ = ["ApplyOptions", "PolicyHandle", "Wrapped", "apply_policy", "audit_policy"]
