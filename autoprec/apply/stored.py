"""The deploy form's weights: each module's tensors stored once in its precision.

At apply, every module's own floating parameters and buffers are replaced by copies in
its region's storage dtype (``precisions.STORAGE_DTYPES``: bf16/fp16 regions hold 16-bit
tensors, fp32/tf32 keep fp32), and a GEMM-format leaf's ``weight`` by its quantised
elements plus scale buffers (``lower.stored.stored_weight``; its bias in the region's
dtype). The model then holds what ``model.to(torch.bfloat16)`` (or a TensorRT engine, or
torchao's quantised tensors) would hold, and ``state_dict()`` saves it.

The fp32 masters: the original Parameter and buffer objects are kept by the handle, not
by the model (``keep_masters=True``, the default). When the model is on an accelerator
they are moved to host memory while the plan is applied, so the device holds only the
deployed weights; ``restore()`` puts the very same objects back (identity, values and
device: an optimizer holding them still works) on the device the deployed copy is on
then (the model moved after apply, ``model.to(device)``, comes back where it went). ``keep_masters=False`` drops them:
``restore()`` then rebuilds fp32 parameters from the stored values, which were rounded
(it warns), for a process that only serves the deployed model.

A tensor shared by two modules (tied embedding and LM head) gets one copy per storage
dtype: two owners in one dtype still share one tensor.

A 16-bit model's fp32 buffers are kept as they are: the model's own code holds them in
fp32 on purpose (transformers builds a Llama's rotary ``inv_freq`` in fp32 and computes
the angles in fp32; rounded to bf16, the angles of a 64-token sequence move by up to
0.01, and the 8 B Llama's logits by 8.5 %, which no plan could then stay under a 5 %
budget). ``model.to(torch.bfloat16)`` does round them; the model as given does not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from autoprec.errors import PolicyWarning
from autoprec.formats.gemm import stores_in_out
from autoprec.formats.precisions import PRECISIONS, STORAGE_DTYPES, is_gemm_format
from autoprec.lower.stored import dequantized_weight, stored_weight
from autoprec.plan.compile import ExecutionPlan
from autoprec.workload.reference import model_reference


@dataclass
class _Slot:
    module: torch.nn.Module
    kind: str  # "_parameters" | "_buffers"
    name: str
    original: torch.Tensor | None  # None: a tensor the deploy form added (scales)
    device: torch.device | None = None  # where the master lived (moved to host)
    fmt: str | None = None  # a GEMM format's quantised weight


@dataclass
class StoredWeights:
    """The deploy form's tensors on a model; ``restore()`` gives the model back."""

    slots: list[_Slot] = field(default_factory=list)
    keep_masters: bool = True
    restored: bool = False

    def restore(self) -> None:
        """Put the original tensors back (idempotent); see the module docstring."""
        if self.restored:
            return
        self.restored = True
        if not self.keep_masters and self.slots:
            warnings.warn("the fp32 masters were dropped at apply (keep_masters=False): the "
                          "restored model holds the deployed values upcast to fp32 (16-bit "
                          "and quantised weights were rounded)", PolicyWarning, stacklevel=3)
        rebuilt = {id(s.original): _rebuilt(s) for s in self.slots
                   if not self.keep_masters and s.original is not None}
        for s in reversed(self.slots):
            table = getattr(s.module, s.kind)
            if s.original is None:
                table.pop(s.name, None)
                continue
            orig = s.original if self.keep_masters else rebuilt[id(s.original)]
            # back from host memory, to where the deployed copy is now (the model may
            # have been moved after apply: ``model.to(device)``)
            cur = table.get(s.name)
            dev = cur.device if cur is not None else s.device
            if dev is not None and orig.device != dev:
                orig.data = orig.data.to(dev)
            table[s.name] = orig

    def copies(self) -> list[torch.Tensor]:
        """The deployed tensors standing in for masters (a tied copy once per slot)."""
        return [getattr(s.module, s.kind)[s.name] for s in self.slots
                if s.original is not None and not self.restored]


def _rebuilt(s: _Slot) -> torch.Tensor:
    """Without masters: fp32 rebuilt from the stored copy (dequantised for a GEMM format),
    in a new tensor of the original's kind (its storage was released at apply)."""
    if s.original is None:  # a tensor the deploy form added: nothing to rebuild
        raise ValueError(f"{s.kind}[{s.name!r}] has no master")
    stored = getattr(s.module, s.kind)[s.name]
    data = (dequantized_weight(s.module, s.fmt) if s.fmt is not None
            else stored.detach().to(s.original.dtype))
    data = data.reshape(s.original.shape) if data.shape == s.original.shape else data.t()
    if isinstance(s.original, torch.nn.Parameter):
        return torch.nn.Parameter(data.contiguous(), requires_grad=s.original.requires_grad)
    return data.contiguous()


def model_bytes(root: torch.nn.Module) -> int:
    """Bytes of the distinct storages of ``root``'s parameters and buffers (a tied tensor
    once): the weight memory a deployment of this model holds."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for t in [*root.parameters(), *root.buffers()]:
        try:
            key = (t.untyped_storage().data_ptr(), str(t.device))
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = (id(t), str(t.device)), t.numel() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        total += size
    return total


def store_weights(root: torch.nn.Module, plan: ExecutionPlan,
                  modules: dict[str, torch.nn.Module], backend_of: dict[str, str],
                  keep_masters: bool = True) -> StoredWeights:
    """Cast or quantise every module's own tensors for the deploy form (module doc).

    ``modules``: path -> module for the plan's paths; ``backend_of``: GEMM format ->
    backend. Nothing is changed when this raises (the slots done so far are restored).
    """
    out = StoredWeights(keep_masters=keep_masters)
    copies: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    # a 16-bit model's fp32 buffers are its own fp32 islands (module doc)
    keep = (torch.float32,) if model_reference(root).default != "fp32" else ()
    try:
        for j, path in enumerate(plan.tree.paths):
            mod = modules.get(path)
            if mod is None:
                continue
            prec = PRECISIONS[int(plan.precision[j])]
            region = PRECISIONS[int(plan.region[j])]
            if is_gemm_format(prec):
                _store_format(out, mod, prec, region, backend_of.get(prec, "emulated"),
                              copies)
            else:
                _store_module(out, mod, STORAGE_DTYPES[region], copies, skip=(), keep=keep)
        if keep_masters:
            _masters_to_host(out)
        else:  # the model's copies are all that is left: free the masters' memory
            released: dict[int, torch.Tensor] = {}  # a tied master: one stand-in, one tie
            for s in out.slots:
                if s.original is not None:
                    key = id(s.original)
                    s.original = released.setdefault(key, _released(s.original))
    except BaseException:
        out.restore()
        raise
    return out


def _released(t: torch.Tensor) -> torch.Tensor:
    """A stand-in with ``t``'s dtype, shape and kind but no storage (meta device): what a
    slot remembers of a dropped master. The model's caller may still hold ``t`` itself."""
    meta = torch.empty_like(t, device="meta")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta


def _replace(out: StoredWeights, mod: torch.nn.Module, kind: str, name: str,
             new: torch.Tensor, orig: torch.Tensor | None, fmt: str | None = None) -> None:
    out.slots.append(_Slot(mod, kind, name, orig, fmt=fmt))
    getattr(mod, kind)[name] = new


def _copy_of(t: torch.Tensor, dtype: torch.dtype, parameter: bool,
             copies: dict[tuple[int, torch.dtype], torch.Tensor]) -> torch.Tensor:
    key = (id(t), dtype)
    got = copies.get(key)
    if got is None:
        data = t.detach().to(dtype)  # callers skip tensors already in ``dtype``
        # requires_grad as the master's, as ``model.to(dtype)`` keeps it: aten's matmul
        # folds a 3-D input into one mm only when the weight requires grad; a frozen copy
        # sends a non-contiguous input (MultiheadAttention's batch_first projections) to
        # bmm over the weight expanded per batch row: 0.73x of fp32 where model.to(bf16)
        # runs 1.6x (examples/nn_transformer, AMD EPYC AVX512-BF16)
        got = torch.nn.Parameter(data, requires_grad=t.requires_grad) if parameter else data
        copies[key] = got
    return got


def _store_module(out: StoredWeights, mod: torch.nn.Module, dtype: torch.dtype,
                  copies: dict[tuple[int, torch.dtype], torch.Tensor],
                  skip: tuple[str, ...], keep: tuple[torch.dtype, ...] = ()) -> None:
    """``mod``'s own floating tensors in ``dtype``, but ``skip`` (names) and buffers in a
    ``keep`` dtype."""
    for kind in ("_parameters", "_buffers"):
        for name, t in list(getattr(mod, kind).items()):
            if t is None or name in skip or not t.is_floating_point() or t.dtype == dtype:
                continue
            if kind == "_buffers" and t.dtype in keep:
                continue
            _replace(out, mod, kind, name,
                     _copy_of(t, dtype, kind == "_parameters", copies), t)


def _store_format(out: StoredWeights, mod: torch.nn.Module, fmt: str, region: str,
                  backend: str, copies: dict[tuple[int, torch.dtype], torch.Tensor]) -> None:
    """A GEMM-format leaf: ``weight`` -> quantised elements (+ scale buffers); the bias
    and any other tensor in the region's dtype."""
    q, scales = stored_weight(mod, fmt, backend)  # (N, K)
    if stores_in_out(mod):  # HF GPT-2's Conv1D stores (K, N): keep its layout
        q = q.t()
    orig = mod._parameters["weight"]
    _replace(out, mod, "_parameters", "weight", torch.nn.Parameter(q, requires_grad=False),
             orig, fmt)
    for name, s in scales.items():
        _replace(out, mod, "_buffers", name, s, None)
    _store_module(out, mod, STORAGE_DTYPES[region], copies, skip=("weight", *scales),
                  keep=(torch.float32,))


def _masters_to_host(out: StoredWeights) -> None:
    """Masters of a model on an accelerator wait in host memory (the device holds only the
    deployed tensors); on a CPU they stay where they are."""
    moved: set[int] = set()
    for s in out.slots:
        o = s.original
        if o is None or o.device.type == "cpu":
            continue
        s.device = o.device
        if id(o) not in moved:
            moved.add(id(o))
            o.data = o.data.to("cpu")
        else:
            s.device = None  # moved (and brought back) once


__all__ = ["StoredWeights", "model_bytes", "store_weights"]
