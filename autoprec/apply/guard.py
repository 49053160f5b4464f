"""A deployed plan guards itself: a non-finite layer output caught at run time.

The error budget was measured on calibration and eval data; a deployment sees other
inputs, and a fp16 layer past 65504 (or a GEMM format in a fp16 region) gives inf / NaN
without a word. The guard (``policy.guard_spec``: the ``guard`` key, or
``apply_policy(guard=...)``) wraps each guarded GEMM leaf and the root:

- the root checks the forward's output: one device scalar, the fp32 sum of its first
  floating tensor (``out.sum(dtype=torch.float32)``: one reduction, no temporary; an inf or
  NaN anywhere makes it non-finite — an overflowed layer's inf reaches the output as inf
  or, through a norm or softmax, NaN. On this project's CPU a sum is ~20x cheaper than
  ``torch.isfinite(out).all()``, which materialises a bool tensor), and reads one bool:
  one host sync per forward, nothing per layer. That read is
  ``torch.compiler.disable``-d: under ``torch.compile`` the graph breaks there, once, at
  the root's exit (the forward itself stays one graph); what runs after an overflow
  (attributing, counting, warning, the fallback re-run) runs eagerly;
- only when the output is non-finite is the same forward run again with each guarded
  leaf's output checked (the same sum per call), to name the layer(s) that overflowed;
  the mode then acts on them. A non-finite output that no guarded layer explains (a
  layer not guarded, the model's own code) is warned about once and returned as it is.
  An overflow that never reaches the output (masked away by the model's code) is not
  reported: nothing wrong reached the caller. A sum is also non-finite when finite
  values sum past fp32's max — an overflow in waiting, counted as one.

Modes: ``detect`` counts and warns once per layer (GuardWarning); ``fallback`` re-runs the
forward with the offending layers raised (each to its fallback precision: their weights
rebuilt from the fp32 masters the handle keeps, in a shadow copy of the leaf run by the
deploy form's own forward; a uniform plan's consumer casts, which a raised layer's other
dtype needs, on the model for the re-run only: ``apply.consumers``) and returns that
result — exactly what the plan with those layers' rules raised computes; a layer still non-finite once raised goes to fp32, and a
forward nothing recovers raises GuardError. ``raise``: GuardError naming the first layer
(in execution order), its precision, and the value its output reaches in the fallback
precision. Every overflow is counted (``guard_stats()``) and reported to ``on_event``.

A guarded leaf called outside a root forward (a submodule run on its own) is not checked.
One forward at a time per handle (the guard's state is the handle's, not per thread).
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from autoprec.apply.consumers import RerunCasts
from autoprec.device.capability import capability
from autoprec.errors import GuardError, GuardWarning, PolicyError
from autoprec.formats.precisions import FORMATS, STORAGE_DTYPES, carrier_of, is_gemm_format, rank
from autoprec.lower.stored import SCALE, SCALE_2, cast_tree, deploy_forward, dequantized_weight
from autoprec.policy.guard_spec import ALL, GuardSpec

#: Wider-range precisions a layer may be raised to, nearest first (fp32 at worst).
FALLBACK_ORDER = ("bf16", "tf32", "fp32")
#: A carrier dtype whose max is below this has a small range (fp16): guarded by default.
_FP32_RANGE = 3.0e38


@dataclass
class GuardCounts:
    """What the guard saw at one layer: calls checked, forwards in which its output was
    non-finite, forwards recovered with it raised."""

    checks: int = 0
    overflows: int = 0
    fallbacks: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class GuardEvent:
    """One layer's overflow in one forward, for a deployment's metrics (``on_event``).

    ``action``: "detected" (detect), "fallback" (recovered in ``fallback_precision``),
    "raised" (GuardError follows). ``value``: the layer's non-finite check value ("inf" /
    "nan"), as a float."""

    layer: str
    precision: str
    action: str
    forward: int
    value: float
    fallback_precision: str | None = None


@dataclass
class GuardedLayer:
    path: str
    module: torch.nn.Module
    precision: str  # what it computes in under the plan
    carrier: str  # the dtype its output is in (its region's for a GEMM format)
    fallback: str  # the precision it re-runs in after an overflow


def small_range(precision: str, region: str) -> bool:
    return FORMATS[carrier_of(precision, region)].max < _FP32_RANGE


def fallback_precision(path: str, precision: str, reasons: Mapping[str, str],
                       device: torch.device,
                       target_runs: Callable[[str], bool] = lambda p: True) -> str:
    """The nearest wider-range precision above ``precision`` that the policy's reason for
    ``path`` does not refuse (``"bf16: …"``), ``device`` runs and the plan's target has
    (``target_runs``: a T4 has no bf16); fp32 at worst."""
    why = reasons.get(path, "")
    for q in FALLBACK_ORDER:
        if rank(q) >= rank(precision) or re.search(rf"\b{q}:", why):
            continue
        if capability(q, None, device)[0] and target_runs(q):
            return q
    return "fp32"


def _flag(out: Any) -> torch.Tensor | None:
    """The fp32 sum of the floating output (the first tensor of a tuple / list / dict:
    a GEMM leaf gives one)."""
    t = out
    while not isinstance(t, torch.Tensor):
        if isinstance(t, (tuple, list)) and t:
            t = t[0]
        elif isinstance(t, Mapping) and t:
            t = next(iter(t.values()))
        else:
            return None
    if not t.is_floating_point():
        return None
    return t.detach().sum(dtype=torch.float32)


class _State:
    """Per forward: the flags of the guarded calls, the raised layers of a re-run."""

    def __init__(self) -> None:
        self.flags: list[tuple[int, torch.Tensor]] | None = None  # None: not in a forward
        self.raised: dict[int, str] | None = None  # layer index -> precision (a re-run)
        self.peaks: dict[int, float] = {}  # max |y| of the raised layers in a re-run


class Guard:
    """The guard of one applied plan (see the module doc); built by ``apply_policy``."""

    def __init__(self, spec: GuardSpec, layers: list[GuardedLayer], form: str,
                 masters: Callable[[torch.nn.Module], dict[str, torch.Tensor]],
                 on_event: Callable[[GuardEvent], None] | None = None,
                 source: str = "<policy>", rerun_casts: RerunCasts | None = None) -> None:
        self.spec = spec
        self.mode = spec.mode
        self.layers = layers
        self.form = form
        self.source = source
        self.on_event = on_event
        self.forwards = 0  # forwards checked
        self.counts = {g.path: GuardCounts() for g in layers}
        self._masters = masters
        self._state = _State()
        self._warned: set[str] = set()
        self._shadows: dict[tuple[int, str, torch.device], Callable[..., Any]] = {}
        # a uniform plan's consumer casts, installed for the re-runs only (apply.consumers);
        # a guarded leaf casts its own inputs in a re-run (``_leaf``), after the choice of
        # a raised layer's shadow, which reads its input in the raised dtype
        leaves = {id(g.module) for g in layers}
        self._rerun_casts = RerunCasts([] if rerun_casts is None else
                                       [(m, p) for m, p in rerun_casts.pairs
                                        if id(m) not in leaves])
        self._check = torch.compiler.disable(self._check_eager)

    # -- installing ------------------------------------------------------------------
    def wrap(self, wrappers: list[tuple[torch.nn.Module, Callable[..., Any]]],
             root: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable[..., Any]]]:
        """``wrappers`` with each guarded leaf's forward checked and the root's settling
        the forward's flags (a leaf with no wrapper gets one around its own forward)."""
        out = list(wrappers)
        at = {id(m): i for i, (m, _) in enumerate(out)}
        for idx, g in enumerate(self.layers):
            i = at.get(id(g.module))
            if i is None:
                out.append((g.module, self._leaf(idx, g.module.forward)))
                at[id(g.module)] = len(out) - 1
            else:
                out[i] = (g.module, self._leaf(idx, out[i][1]))
        i = at.get(id(root))
        if i is None:
            out.append((root, self._root(root.forward)))
        else:
            out[i] = (root, self._root(out[i][1]))
        return out

    def _leaf(self, idx: int, base: Callable[..., Any]) -> Callable[..., Any]:
        st = self._state
        g = self.layers[idx]
        # in a re-run a layer upstream may give another dtype than the plan's: a 16-bit
        # leaf casts its inputs to its weights' (a GEMM format reads any dtype)
        dtype = None if is_gemm_format(g.precision) else STORAGE_DTYPES[g.precision]

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if st.raised is None:
                out = base(*args, **kwargs)
            elif idx in st.raised:  # a fallback re-run: this layer raised
                out = self._raised(idx, st.raised[idx])(*args, **kwargs)
                st.peaks[idx] = _peak((args, out))
            elif dtype is not None:
                out = base(*cast_tree(args, dtype), **cast_tree(kwargs, dtype))
            else:
                out = base(*args, **kwargs)
            if st.flags is not None:
                f = _flag(out)
                if f is not None:
                    st.flags.append((idx, f))
            return out

        return guarded

    def _root(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        st = self._state

        def guarded_root(*args: Any, **kwargs: Any) -> Any:
            if st.flags is not None:  # re-entered, or an attributing re-run: the outer acts
                return inner(*args, **kwargs)
            out = inner(*args, **kwargs)
            flag = _flag(out)
            if torch.compiler.is_compiling():  # the graph ends here (module doc)
                return self._check(out, flag, inner, args, kwargs)
            return self._check_eager(out, flag, inner, args, kwargs)  # no disable wrapper

        return guarded_root

    def _check_eager(self, out: Any, flag: torch.Tensor | None, inner: Callable[..., Any],
                     args: Any, kwargs: Any) -> Any:
        """The one host sync of a guarded forward (``bool`` below); on a non-finite output,
        the forward again with every guarded leaf checked, to name the layers."""
        if flag is None or bool(torch.isfinite(flag)):
            self.forwards += 1
            for g in self.layers:
                self.counts[g.path].checks += 1
            return out
        st = self._state
        st.flags = []
        try:
            again = inner(*args, **kwargs)
        finally:
            flags, st.flags = st.flags, None
        if not _bad(flags):
            key = "<output>"
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(f"{self.source}: guard: the forward's output is not finite, "
                              "but no guarded layer overflowed (a layer the guard does not "
                              "check, or the model's own code): returned as it is",
                              GuardWarning, stacklevel=4)
        return self._settle_eager(again, flags, inner, args, kwargs)

    # -- after a forward -------------------------------------------------------------
    def _settle_eager(self, out: Any, flags: list[tuple[int, torch.Tensor]],
                      inner: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Count the forward's checks; on a non-finite flag act by the mode. The one host
        sync of a guarded forward (``bool`` below)."""
        self.forwards += 1
        if not flags:
            return out
        for idx, _ in flags:
            self.counts[self.layers[idx].path].checks += 1
        values = torch.stack([f for _, f in flags])
        if bool(torch.isfinite(values).all()):
            return out
        bad = _bad(flags)  # layer index -> its check value, in execution order
        for idx in bad:
            self.counts[self.layers[idx].path].overflows += 1
        first = next(iter(bad))
        if self.mode == "detect":
            for idx, v in bad.items():
                after = "" if idx == first else \
                    f" (after {self.layers[first].path!r}, the first in that forward)"
                self._report(idx, "detected", v, f"; the output was returned as is{after}")
            return out
        recovered, levels = self._rerun(inner, args, kwargs, bad)
        for idx in levels:
            if idx not in bad:  # flagged only once an earlier layer was raised
                self.counts[self.layers[idx].path].overflows += 1
        if self.mode == "raise" or recovered is None:
            for idx, v in bad.items():
                self._report(idx, "raised", v)
            raise self._error(first, bad[first], levels, recovered is not None)
        names = ", ".join(f"{self.layers[i].path!r} in {p}" for i, p in levels.items())
        for idx, v in bad.items():
            self._report(idx, "fallback", v, f"; re-ran with {names} and returned that result",
                         levels.get(idx))
        for idx in levels:
            self.counts[self.layers[idx].path].fallbacks += 1
        return recovered

    def _rerun(self, inner: Callable[..., Any], args: Any, kwargs: Any,
               bad: Mapping[int, float]) -> tuple[Any, dict[int, str]]:
        """Re-run with the first flagged layer (in execution order) raised, then the first
        still flagged, until the output is finite: the layers downstream of an overflow
        (fed its inf / NaN) are flagged too, and are left as they are once it is fixed. A
        raised layer still first goes to fp32; (None, levels) when that does not help.
        Eager (called from the disabled settle)."""
        if self.form != "deploy":
            return None, {}  # raise in the train form: no shadow weights to re-run with
        levels: dict[int, str] = {}
        first = next(iter(bad))
        st = self._state
        try:
            with self._rerun_casts.installed():
                for _ in range(2 * len(self.layers)):
                    if first not in levels:
                        levels[first] = self.layers[first].fallback
                    elif levels[first] != "fp32":
                        levels[first] = "fp32"
                    else:
                        return None, levels
                    st.raised, st.flags, st.peaks = dict(levels), [], {}
                    out = inner(*args, **kwargs)
                    flags, st.flags = st.flags, None
                    again = _bad(flags)
                    if not again:
                        return out, levels
                    first = next(iter(again))
                return None, levels
        finally:
            st.raised, st.flags = None, None

    def _raised(self, idx: int, precision: str) -> Callable[..., Any]:
        """Layer ``idx`` in ``precision``: a shadow of the leaf holding its fp32 masters in
        that precision's storage dtype, run by the deploy form's forward (built once per
        device)."""
        g = self.layers[idx]
        # keyed by the device too: a model moved after apply re-runs where it is now
        key = (idx, precision, next((t.device for t in g.module.parameters()),
                                    torch.device("cpu")))
        fwd = self._shadows.get(key)
        if fwd is None:
            fwd = deploy_forward(_shadow(g.module, self._masters(g.module),
                                         STORAGE_DTYPES[precision]), precision)
            self._shadows[key] = fwd
        return fwd

    def _report(self, idx: int, action: str, value: float, then: str = "",
                fallback: str | None = None) -> None:
        g = self.layers[idx]
        if self.on_event is not None:
            self.on_event(GuardEvent(g.path, g.precision, action, self.forwards, value,
                                     fallback))
        if action != "raised" and g.path not in self._warned:
            self._warned.add(g.path)
            warnings.warn(f"guard: layer {g.path!r} ({g.precision}) gave a non-finite output "
                          f"({_num(value)}) on forward {self.forwards}{then} (counted in "
                          "guard_stats(); warned once per layer)", GuardWarning, stacklevel=2)

    def _error(self, idx: int, value: float, levels: Mapping[int, str],
               recovered: bool) -> GuardError:
        g = self.layers[idx]
        limit = FORMATS[g.carrier].max
        peak = self._state.peaks.get(idx)
        if recovered and peak is not None and idx in levels:
            what = (f"its input or output reaches {peak:.3g} > {limit:g}, the {g.carrier} "
                    f"maximum (recomputed in {levels[idx]})" if peak > limit else
                    f"max |x|, |y| {peak:.3g} recomputed in {levels[idx]}")
        else:
            what = f"{_num(value)} (not finite even with the layers raised to fp32)" \
                if self.mode == "fallback" else _num(value)
        more = len(levels) - 1
        also = f"; {more} more layer(s) after it overflowed too" if more > 0 else ""
        return GuardError(f"{self.source}: guard: layer {g.path!r} ({g.precision}) overflowed "
                          f"on forward {self.forwards}: {what}{also}", g.path)

    # -- reading ---------------------------------------------------------------------
    def stats(self) -> dict[str, GuardCounts]:
        """Per guarded layer: checks, overflows, fallbacks (copies)."""
        return {p: GuardCounts(**asdict(c)) for p, c in self.counts.items()}

    def fallback_layers(self) -> dict[str, str]:
        """Each guarded layer's fallback precision."""
        return {g.path: g.fallback for g in self.layers}


def _bad(flags: Sequence[tuple[int, torch.Tensor]]) -> dict[int, float]:
    """Layer index -> check value of the calls whose flag is non-finite, first seen first."""
    out: dict[int, float] = {}
    for idx, f in flags:
        v = float(f)
        if not math.isfinite(v) and idx not in out:
            out[idx] = v
    return out


def _peak(obj: Any) -> float:
    """max |value| over the floating tensors in ``obj`` (a layer's inputs and output)."""
    peak = 0.0
    stack = [obj]
    while stack:
        t = stack.pop()
        if isinstance(t, torch.Tensor):
            if t.is_floating_point() and t.numel():
                peak = max(peak, float(t.detach().abs().amax()))
        elif isinstance(t, (tuple, list)):
            stack.extend(t)
        elif isinstance(t, Mapping):
            stack.extend(t.values())
    return peak


def _num(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _shadow(module: torch.nn.Module, masters: Mapping[str, torch.Tensor],
            dtype: torch.dtype) -> torch.nn.Module:
    """A copy of leaf ``module`` (its class forward, not the installed one) whose floating
    parameters and buffers are ``masters`` (fp32) in ``dtype``; a GEMM format's scales
    dropped (the weight is a plain tensor again)."""
    sh = copy.copy(module)
    sh.__dict__.pop("forward", None)
    sh._parameters = {}
    sh._buffers = {}
    for kind in ("_parameters", "_buffers"):
        for name, t in getattr(module, kind).items():
            if name in (SCALE, SCALE_2) and kind == "_buffers":
                continue
            t = masters.get(name, t)
            if t is not None and t.is_floating_point():
                t = t.detach().to(dtype)
            if kind == "_parameters" and t is not None:
                t = torch.nn.Parameter(t, requires_grad=False)
            getattr(sh, kind)[name] = t
    return sh


def stored_masters(slots: Sequence[Any]) -> Callable[[torch.nn.Module], dict[str, torch.Tensor]]:
    """For ``Guard``: a module -> its fp32 tensors by name, from the deploy form's slots
    (``apply.stored``): the kept masters on the module's device, or — masters dropped —
    the stored values upcast (a quantised weight dequantised)."""

    def of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for s in slots:
            if s.module is not module or s.original is None:
                continue
            o = s.original
            if o.device.type == "meta":  # keep_masters=False
                cur = getattr(module, s.kind)[s.name]
                data = dequantized_weight(module, s.fmt) if s.fmt is not None else cur.float()
                if data.shape != o.shape:
                    data = data.t()
                out[s.name] = data.float()
            else:
                dev = next((t.device for t in module.parameters()), o.device)
                out[s.name] = o.detach().to(dev)
        return out

    return of


def select_layers(spec: GuardSpec, gemm_paths: Sequence[str],
                  modules: Mapping[str, torch.nn.Module], resolved: Mapping[str, Any],
                  reasons: Mapping[str, str], device: torch.device,
                  source: str, target_runs: Callable[[str], bool] = lambda p: True
                  ) -> list[GuardedLayer]:
    """The guarded layers (``guard.layers``: absent: the small-range ones; ``all``; a
    list, each a GEMM layer of the model) in the model's order, with fallbacks."""
    known = list(gemm_paths)
    if spec.layers is None:
        paths = [p for p in known
                 if small_range(resolved[p].precision, resolved[p].region)]
    elif spec.layers == ALL:
        paths = known
    else:
        have = set(known)
        for i, p in enumerate(spec.layers):
            if p not in have:
                raise PolicyError(f"{source}: guard.layers[{i}]: {p!r} is not a GEMM layer of "
                                  "the model (the guard checks Linear / conv leaves)")
        paths = [p for p in known if p in set(spec.layers)]
    for p in spec.fallback:
        if p not in paths:
            raise PolicyError(f"{source}: guard.fallback[{p!r}]: not a guarded layer (guarded: "
                              f"{', '.join(paths[:5]) or 'none'}{', …' if len(paths) > 5 else ''})")
    out = []
    for p in paths:
        r = resolved[p]
        fb = spec.fallback.get(p) or fallback_precision(p, r.precision, reasons, device,
                                                         target_runs)
        out.append(GuardedLayer(p, modules[p], r.precision, carrier_of(r.precision, r.region),
                                fb))
    return out


__all__ = ["FALLBACK_ORDER", "Guard", "GuardCounts", "GuardEvent", "GuardedLayer",
           "fallback_precision", "select_layers", "small_range",
           "stored_masters"]
