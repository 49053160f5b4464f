"""A model streamed from its checkpoint: one repeated block in memory at a time.

``open_streamed(folder)`` builds the skeleton (``checkpoint.Checkpoint``), finds the
repeated blocks (``find_blocks``: the ModuleList of same-class modules holding the most
parameters, e.g. ``model.layers`` of a Llama) and loads everything else — embeddings,
final norm, LM head — once (*resident*). The result is an ordinary ``nn.Module`` whose
blocks are on ``meta`` until called:

- **a plain forward** (the reference, the trace, the probes): a forward pre-hook on each
  block reads its weights from the shards and a forward hook puts them back on ``meta``,
  as accelerate's disk offload does; the numbers are the loaded model's, op for op.
- **a forward under a plan** (``StreamedModel.lowered``): a plan cannot be installed on
  ``meta`` weights (the deploy form casts and quantises each weight when it is applied), so
  the model's own forward is run once per block on a *shell*: the blocks list replaced by
  ``[Inject(h)] * i + [block_i]``, where ``Inject`` hands on what the blocks before returned
  under the plan (``h``), and a forward hook on ``block_i`` stops the forward with its
  output. The plan is applied to that shell (``lower(model, absent)``: the caller restricts
  the rules to the modules present) after ``block_i`` is loaded and removed before it is
  offloaded; a last pass with ``Inject`` alone runs the resident tail (norm, LM head).
  Each block therefore runs inside the model's own forward, under the root's region, with
  the keyword arguments (rotary embeddings, masks) the model computes under the same plan:
  what the loaded model computes under that plan, block by block.
- **Per shell**, the resident modules holding weights (embeddings, final norm, LM head)
  are installed and run once per forward, not once per block: block 0's shell records
  what each returned; the later shells replace a module that returned one output by an
  ``Inject`` of it (no gradients are wanted) and a module that returned none (it runs after
  the blocks: the LM head) by ``NotInShell``, and the plan leaves both out. An 8 B Llama's
  LM head is 1 GB in bf16: an fp8 rule on it, installed in each of 33 shells, quantised it
  33 times a forward and held ~4 GB while doing so.

**Replay.** A forward that computes its first blocks as an earlier forward did on the same
inputs starts after them (``replaying``; ``lowered(..., kind=, given=)``): the caller
names the kind of forward (a plan's form, default dtype and target; a plain forward) and
the first block it computes differently (a plan's first rule; the layer an end-to-end probe
lowers), and the blocks' outputs are kept as forwards of that kind compute them (without
gradients only; ``REPLAY_BYTES`` in all). An 8 B probe's end-to-end run of a layer in
block 20 runs 12 blocks, not 32.

Memory: the resident parts, one block (in its stored dtype, plus a plan's copies of it)
and the activations of one batch; ``StreamedModel.memory`` names the largest block. A
forward with gradients (the probes' shadow pass runs backwards through the whole forward
after it) would keep every block's weights alive in the autograd graph, since a GEMM saves
its weight for the input's gradient: while a plain forward runs, a saved tensor that is a
loaded block's parameter (or a view of one, as ``weight.t()``) is saved as where it lies in
the checkpoint (``_SavedWeight``) and read back from the shards when the backward needs it
(``torch.autograd.graph.saved_tensors_hooks``) — the same bytes, so the same gradients.
The blocks' weights take no gradient (``requires_grad`` off: their gradient accumulators
would hold them too); gradients with respect to activations are as the loaded model's.
Under autocast (a training plan over fp32 masters) a GEMM saves autocast's bf16 copy of the
weight, not the weight: the casts of a loaded weight are watched (``_CastWatch``) and a
saved copy is read back and cast again the same way (an 8 B's bf16 copies, 16 GB, were
otherwise kept until the backward: the training-form tune was killed for memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autoprec.errors import ModelFileError
from autoprec.stream.checkpoint import Checkpoint, offload, swap_in

#: Bytes of block outputs ``StreamedModel`` keeps for replay, all kinds and inputs together
#: (an 8 B Llama's 32 block outputs for 1 x 64 tokens: 16 MB).
REPLAY_BYTES = 512 << 20

#: ``lower(model, absent, call)``: install the plan on the shell (restricted to the modules
#: present: ``absent`` are the blocks not loaded), return ``call()``, remove the plan.
Lower = Callable[[nn.Module, frozenset[str], Callable[[], Any]], Any]


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Loading and offloading weights are not the model's ops: hidden from the torch
    function and dispatch modes a tracer, the op recorder or an audit has open."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The path and ModuleList of the model's repeated blocks: among the ModuleLists of at
    least two children of one class, the one holding the most parameter elements."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if best is None or n > best[0]:
            best = (n, path, mod)
    if best is None:
        raise ModelFileError(f"{type(model).__name__}: no list of repeated blocks to stream "
                             "(a ModuleList of two or more modules of one class)")
    return best[1], best[2]


class _Stopped(Exception):  # noqa: N818 - control flow, never seen by a user
    """Raised by the hook on the shell's last block: its output, as the model's loop got it."""

    def __init__(self, output: Any) -> None:
        super().__init__("streamed block finished")
        self.output = output


@dataclass(frozen=True)
class _SavedWeight:
    """A saved-for-backward view of a block parameter (or of a cast copy of one): its
    checkpoint name, the dtype it is held in, the copy's dtype, the view."""

    key: str
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    cast: torch.dtype | None = None


class _CastWatch(TorchDispatchMode):
    """Notes every whole-tensor cast of a loaded block parameter (autocast's copies) in
    ``StreamedModel._casts``: its storage -> (the copy, the parameter's name, dtypes)."""

    def __init__(self, stream: StreamedModel) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            src = args[0]
            hit = self.stream._loaded.get(src.untyped_storage().data_ptr())
            if (hit is not None and src.storage_offset() == 0 and src.is_contiguous()
                    and src.numel() * src.element_size() == src.untyped_storage().nbytes()
                    and out.is_contiguous()):
                self.stream._casts[out.untyped_storage().data_ptr()] = (
                    weakref.ref(out), hit[0], hit[1], out.dtype)
        return out


class Inject(nn.Module):
    """Stands for modules whose output is known: the blocks before the one being run (what
    they returned under the plan), or a resident module in a later block's shell (what it
    returned in block 0's shell: same inputs, same plan)."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


class NotInShell(nn.Module):
    """Stands for a resident module that runs only after the blocks (an LM head) in a
    block's shell; called there, the model cannot be streamed as it was seen to run."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelFileError(f"{self.path}: ran in a later block's forward but not in the "
                             "first's; this model cannot be streamed")


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """Put ``module`` at ``path``; returns the module that was there."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = parent._modules[attr]
    parent._modules[attr] = module
    return old  # type: ignore[return-value]


@dataclass(frozen=True)
class StreamMemory:
    """What a streamed model holds, from the checkpoint's headers."""

    resident_bytes: int
    largest_block: str
    largest_block_bytes: int
    blocks: int
    #: the resident module holding the most bytes (an LM head, the embeddings): a plan
    #: may hold a copy of it beside it
    largest_resident: str = ""
    largest_resident_bytes: int = 0
    #: how much larger than held a plan's widest copy of a weight is (fp32 over the held
    #: dtype: 2 for bf16 weights, 1 for fp32 masters)
    widen: float = 1.0


class StreamedModel:
    """The streaming state of one skeleton model (attached as ``model.autoprec_stream``)."""

    def __init__(self, ckpt: Checkpoint, model: nn.Module, path: str,
                 blocks: nn.ModuleList) -> None:
        self.ckpt, self.model, self.path, self.blocks = ckpt, model, path, blocks
        self.parent_path, _, self.attr = path.rpartition(".")
        self.parent = model.get_submodule(self.parent_path) if self.parent_path else model
        self.lower: Lower | None = None  # set while a plan is applied (``lowered``)
        self._in_shell = False
        self.loads = 0  # blocks read from the shards (tests, progress)
        self.on_block: Callable[[int, int], None] | None = None  # progress: (i, n)
        #: told (old, new) for every parameter replaced by a load or an offload (the op
        #: recorder knows parameters by object: ``trace.op_recorder``)
        self.listeners: list[Callable[[torch.Tensor, torch.Tensor], None]] = []
        #: storage address -> checkpoint name and dtype of each loaded block parameter
        self._loaded: dict[int, tuple[str, torch.dtype]] = {}
        #: storage address -> (copy, name, held dtype, copy dtype) of each cast of a loaded
        #: block parameter in a forward with gradients (``_CastWatch``)
        self._casts: dict[int, tuple[Any, str, torch.dtype, torch.dtype]] = {}
        self.reloads = 0  # weights read back for a backward (tests)
        self._plain = model.forward
        #: resident modules a forward under a plan ran only after the blocks (the LM head):
        #: left out of block 0's shell from then on (``_units_for_shell``)
        self._after: frozenset[str] = frozenset()
        #: replay (module doc): (kind, inputs digest) -> the first blocks' outputs
        self._kept: dict[tuple[Hashable, str], list[Any]] = {}
        self._kept_bytes = 0
        self._given: tuple[Hashable, int] | None = None  # (kind, first block computed anew)
        self._keeping: tuple[list[Any], int] | None = None  # a plain forward's (kept, given)
        self._index = {id(b): i for i, b in enumerate(blocks)}
        self.replayed = 0  # blocks not computed thanks to replay (tests, progress)
        #: the resident modules holding parameters of their own, outside the blocks and
        #: not above them (embeddings, final norm, LM head)
        self.units = {name: mod for name, mod in model.named_modules()
                      if any(True for _ in mod.parameters(recurse=False))
                      and not (name == path or name.startswith(path + ".")
                               or path.startswith(name + ".") or name == "")}
        # no gradient for a streamed weight: an AccumulateGrad node would keep it alive;
        #: the block parameters the model trains (a training step prices their gradients)
        self.trainable = frozenset(f"{path}.{n}" for n, p in blocks.named_parameters()
                                   if p.requires_grad)
        for p in blocks.parameters():
            p.requires_grad_(False)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._pre_hook(i))
            block.register_forward_hook(self._post_hook)
        model.forward = self._forward  # type: ignore[method-assign]

    # -- loading ------------------------------------------------------------------------
    def block_path(self, i: int) -> str:
        return f"{self.path}.{i}"

    def load_block(self, i: int) -> None:
        block = self.blocks[i]
        if any(p.device.type == "meta" for p in block.parameters()):
            fake = detect_fake_mode()
            if fake is not None:  # torch.export runs on fake tensors: shapes, not weights
                self._load_fake(block, fake)
                return
            with unobserved():
                self.ckpt.load(block, self.block_path(i), self._swapped)
            self.loads += 1
            for name, p in block.named_parameters():
                self._loaded[p.untyped_storage().data_ptr()] = (
                    f"{self.block_path(i)}.{name}", p.dtype)

    def _load_fake(self, block: nn.Module, fake: Any) -> None:
        """The block's parameters as fake tensors of the loaded dtype and device: a tracer
        on fake tensors (non-strict ``torch.export``) captured the real ones it met as
        constants and held every block's weights until it ended."""
        held = self.ckpt.load_dtype
        for name, p in list(block.named_parameters()):
            if p.device.type == "meta":
                with fake:
                    value = torch.empty(p.shape, dtype=held or p.dtype, device=self.ckpt.device)
                swap_in(block, name, value, self._swapped)

    def _offload(self, block: nn.Module) -> None:
        if detect_fake_mode() is None:  # fake parameters were never in ``_loaded``
            for p in block.parameters():
                if p.device.type != "meta":
                    self._loaded.pop(p.untyped_storage().data_ptr(), None)
        with unobserved():
            offload(block, self._swapped)

    # -- a backward through streamed blocks (module doc) ----------------------------------
    @contextlib.contextmanager
    def saving_weights_as_read(self) -> Iterator[None]:
        """While open, a forward with gradients saves a loaded block weight (or autocast's
        copy of one) for its backward as where it lies in the checkpoint, read back when
        the backward needs it (module doc): what the model's forward does with gradients,
        for a caller running one block itself (``probe.blockwise``)."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    _CastWatch(self):
                yield
        finally:
            self._casts.clear()

    @contextlib.contextmanager
    def held(self, i: int, trained: bool = False) -> Iterator[None]:
        """While open, block ``i``'s weights are loaded (offloaded at the end); ``trained``:
        the ones the model trains require grad meanwhile (a gradient probe's wgrad)."""
        self.load_block(i)
        block = self.blocks[i]
        mine = [p for n, p in block.named_parameters()
                if trained and f"{self.block_path(i)}.{n}" in self.trainable]
        try:
            for p in mine:
                p.requires_grad_(True)
            yield
        finally:
            for p in block.parameters():  # never kept: an offloaded block loads without
                p.requires_grad_(False)
            self._offload(block)

    @contextlib.contextmanager
    def blocks_replaced(self, modules: list[nn.Module]) -> Iterator[None]:
        """While open, the model's blocks list holds ``modules`` (stand-ins: ``Inject``)."""
        setattr(self.parent, self.attr, nn.ModuleList(modules))
        try:
            yield
        finally:
            setattr(self.parent, self.attr, self.blocks)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._loaded or t.device.type == "meta":
            return t
        ptr = t.untyped_storage().data_ptr()
        copy = self._casts.get(ptr)
        if copy is not None:
            ref, key, dtype, cast = copy
            alive = ref()  # alive: its storage is still this copy's (not a reused address)
            if alive is not None and alive.untyped_storage().data_ptr() == ptr:
                return _SavedWeight(key, dtype, tuple(t.size()), tuple(t.stride()),
                                    t.storage_offset(), cast)
        hit = self._loaded.get(ptr)
        if hit is None or self.model.get_parameter(hit[0]).untyped_storage().data_ptr() != ptr:
            return t  # not a weight, or a stale address (a forward that raised mid-block)
        return _SavedWeight(hit[0], hit[1], tuple(t.size()), tuple(t.stride()),
                            t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        with unobserved():
            ((_, value),) = self.ckpt._tensors([saved.key])
            self.reloads += 1
            value = value.to(saved.dtype)  # the parameter as it was held
            if saved.cast is not None:
                value = value.to(saved.cast)  # the copy, cast again as the forward did
            return value.as_strided(saved.size, saved.stride, saved.offset)

    def _pre_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self._in_shell:
                self.load_block(i)
                if self.on_block is not None:
                    self.on_block(i, len(self.blocks))
        return hook

    def _post_hook(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self._in_shell:
            self._offload(module)
            if self._keeping is not None:
                self._keep(*self._keeping, self._index[id(module)], out)

    def _swapped(self, old: torch.Tensor, new: torch.Tensor) -> None:
        for fn in self.listeners:
            fn(old, new)

    @property
    def memory(self) -> StreamMemory:
        sizes = [(self.ckpt.bytes_under(self.block_path(i), held=True), self.block_path(i))
                 for i in range(len(self.blocks))]
        top, where = max(sizes)
        total = self.ckpt.bytes_under("", held=True)
        units = [(self.ckpt.bytes_under(path, held=True), path) for path in self.units]
        unit_bytes, unit = max(units) if units else (0, "")
        held = self.ckpt.load_dtype or self.ckpt.dtype()
        return StreamMemory(total - sum(s for s, _ in sizes), where, top, len(self.blocks),
                            unit, unit_bytes, max(1.0, 4 / held.itemsize))

    def weights_hash(self) -> str:
        """The weights' identity from the checkpoint's headers, sizes and mtimes."""
        return self.ckpt.fingerprint()

    # -- a plan, block by block ---------------------------------------------------------
    @property
    def after_blocks(self) -> frozenset[str]:
        """The resident modules a forward under a plan ran only after the blocks (the LM
        head); empty until one has run."""
        return self._after

    def block_of(self, path: str) -> int | None:
        """The index of the block ``path`` is (in), None for a path outside the blocks."""
        prefix = self.path + "."
        if not path.startswith(prefix):
            return None
        head = path[len(prefix):].split(".")[0]
        return int(head) if head.isdigit() and int(head) < len(self.blocks) else None

    @contextlib.contextmanager
    def lowered(self, lower: Lower, kind: Hashable | None = None,
                given: int = 0) -> Iterator[StreamedModel]:
        """While open, a forward of the model runs block by block, each shell's forward
        through ``lower`` (``Lower``; module doc); ``kind`` / ``given``: as ``replaying``."""
        if self.lower is not None:
            raise RuntimeError("a plan is already applied to this streamed model")
        self.lower = lower
        try:
            with self.replaying(kind, given) if kind is not None else contextlib.nullcontext():
                yield self
        finally:
            self.lower = None

    @contextlib.contextmanager
    def replaying(self, kind: Hashable, given: int) -> Iterator[None]:
        """While open, the caller promises that a forward computes blocks ``0 .. given-1``
        as every forward of ``kind`` does (module doc, "Replay"): their outputs are kept as
        computed, and a forward on inputs seen before starts at the first block not kept."""
        old, self._given = self._given, (kind, max(0, given))
        try:
            yield
        finally:
            self._given = old

    def _start(self, args: Any, kwargs: Any) -> tuple[list[Any] | None, int, int]:
        """(the outputs kept for this forward's kind and inputs, the block it starts at,
        the blocks it may keep); (None, 0, 0) when nothing is replayed."""
        if self._given is None or torch.is_grad_enabled():
            return None, 0, 0
        kind, given = self._given
        key = inputs_digest(args, kwargs) if given > 0 else None
        if key is None:
            return None, 0, 0
        kept = self._kept.setdefault((kind, key), [])
        start = min(len(kept), given)
        self.replayed += start
        return kept, start, given

    def _keep(self, kept: list[Any], given: int, i: int, out: Any) -> None:
        """Keep block ``i``'s output when it is the next one and computed as given."""
        if i >= given or len(kept) != i:
            return
        size = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                   if isinstance(t, torch.Tensor))
        if self._kept_bytes + size > REPLAY_BYTES:
            return
        self._kept_bytes += size
        kept.append(tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor)
                             else t, out))

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_shell or detect_fake_mode() is not None:  # fake: no weights to keep
            return self._plain(*args, **kwargs)
        kept, start, given = self._start(args, kwargs)
        if self.lower is None:
            if not torch.is_grad_enabled():
                return self._plain_from(kept, start, given, args, kwargs)
            with self.saving_weights_as_read():
                return self._plain(*args, **kwargs)
        lower, n = self.lower, len(self.blocks)
        every = frozenset(self.block_path(j) for j in range(n))
        h: Any = kept[start - 1] if kept is not None and start else None
        ran: dict[str, list[Any]] = {}
        try:
            for i in range(start, n):
                block = self.blocks[i]
                self.load_block(i)
                if self.on_block is not None:
                    self.on_block(i, n)
                shell = nn.ModuleList([Inject(h) for _ in range(i)] + [block])
                handle = block.register_forward_hook(_stop)
                try:
                    with self._units_for_shell(i, ran, first=i == start) as gone:
                        h = self._shell_call(shell, lower,
                                             (every - {self.block_path(i)}) | gone,
                                             args, kwargs, stop=True)
                finally:
                    handle.remove()
                    self._offload(block)
                if kept is not None:
                    self._keep(kept, given, i, h)
            tail = nn.ModuleList([Inject(h) for _ in range(n)])
            with self._units_for_shell(n, ran, first=start == n) as gone:
                return self._shell_call(tail, lower, every | gone, args, kwargs, stop=False)
        finally:
            setattr(self.parent, self.attr, self.blocks)

    def _plain_from(self, kept: list[Any] | None, start: int, given: int, args: Any,
                    kwargs: Any) -> Any:
        """A plain forward without gradients, from block ``start`` on (the blocks before
        stand in by ``Inject`` of the kept output), keeping outputs up to ``given``."""
        if kept is None:
            return self._plain(*args, **kwargs)
        if start:
            setattr(self.parent, self.attr, nn.ModuleList(
                [Inject(kept[start - 1]) for _ in range(start)] + list(self.blocks)[start:]))
        self._keeping = (kept, given)
        try:
            return self._plain(*args, **kwargs)
        finally:
            self._keeping = None
            setattr(self.parent, self.attr, self.blocks)

    @contextlib.contextmanager
    def _units_for_shell(self, i: int, ran: dict[str, list[Any]],
                         first: bool) -> Iterator[frozenset[str]]:
        """The resident modules in block ``i``'s shell (``i == n``: the tail's; module doc,
        "Per shell"). The ``first`` shell of a forward (block 0's, or where a replay
        starts) records, per module, the outputs it returned; a module
        an earlier forward saw run only after the blocks (the LM head) is a ``NotInShell``
        there, neither installed nor run. The later shells hold an ``Inject`` of a module
        that returned one output (without gradients) and a ``NotInShell`` of one that
        returned none; the tail runs the latter. Yields the paths taken out, for the plan
        to leave alone."""
        swapped: dict[str, nn.Module] = {}
        handles = []
        if first and i < len(self.blocks):
            def record(path: str) -> Callable[..., None]:
                def hook(module: nn.Module, args: Any, out: Any) -> None:
                    ran.setdefault(path, []).append(out)
                return hook

            for path, mod in self.units.items():
                if path in self._after:
                    swapped[path] = NotInShell(path)
                else:
                    handles.append(mod.register_forward_hook(record(path)))
        else:
            for path in self.units:
                outs = ran.get(path, [])
                if not outs:
                    if i < len(self.blocks):
                        swapped[path] = NotInShell(path)
                elif len(outs) == 1 and not torch.is_grad_enabled():
                    swapped[path] = Inject(outs[0])
        originals = {path: _swap(self.model, path, stand_in)
                     for path, stand_in in swapped.items()}
        try:
            yield frozenset(swapped)
        finally:
            for hd in handles:
                hd.remove()
            for path, mod in originals.items():
                _swap(self.model, path, mod)
        if first and i < len(self.blocks):  # what ran in no block's shell runs after them
            self._after = frozenset(p for p in self.units if p not in ran)

    def _shell_call(self, shell: nn.ModuleList, lower: Lower, absent: frozenset[str],
                    args: Any, kwargs: Any, stop: bool) -> Any:
        stopped: list[Any] = []

        def call() -> Any:
            try:
                return self.model(*args, **kwargs)
            except _Stopped as s:
                stopped.append(s.output)
                return None

        setattr(self.parent, self.attr, shell)
        self._in_shell = True
        try:
            out = lower(self.model, absent, call)
        finally:
            self._in_shell = False
            setattr(self.parent, self.attr, self.blocks)
        if stop:
            if not stopped:
                raise ModelFileError(f"{self.ckpt.folder}: the model's forward did not call "
                                     f"its blocks ({self.path}) in order; it cannot be "
                                     "streamed")
            return stopped[0]
        return out


_ATOMS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def inputs_digest(args: Any, kwargs: Any) -> str | None:
    """A digest of a forward's inputs, tensors by their bytes; None when one is an object
    it cannot read (a KV-cache): such a forward is not replayed. (``workload.hashing``
    hashes data the same way; ``workload`` imports ``stream``, so not from there.)"""
    h = hashlib.sha256()
    leaves, spec = tree_flatten((args, kwargs))
    h.update(repr(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().to("cpu").contiguous()
            h.update(f"{tuple(t.shape)} {t.dtype} {leaf.device}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(leaf, _ATOMS):
            h.update(repr(leaf).encode())
        else:
            return None
    return h.hexdigest()


def _stop(module: nn.Module, args: Any, out: Any) -> None:
    raise _Stopped(out)


def open_streamed(folder: str | Path, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> nn.Module:
    """The causal LM of a checkpoint folder, streamed (module doc): resident parts loaded,
    blocks on ``meta``, ``model.autoprec_stream`` its ``StreamedModel``. ``dtype``: hold
    the weights in it (fp32: a training plan's masters, as a trainer initialises them from
    the stored bf16); default: as stored. ``device``: where the resident parts and the
    block being run are held (a GPU: one block on it at a time, the rest in the shards)."""
    ckpt = Checkpoint(folder, dtype, device)
    model = ckpt.skeleton()
    for mod in model.modules():  # buffers (rotary inv_freq) are built on the host
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != ckpt.device and buf.device.type != "meta":
                mod._buffers[name] = buf.to(ckpt.device)
    path, blocks = find_blocks(model)
    inside = path + "."
    for name, mod in model.named_modules():
        if name == path or name.startswith(inside):
            continue
        if any(True for _ in mod.parameters(recurse=False)):
            _load_own(ckpt, mod, name)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, p in model.named_parameters()
            if p.device.type == "meta" and not n.startswith(inside)]
    if left:
        raise ModelFileError(f"{folder}: the checkpoint holds no tensor {left[0]!r}")
    model.autoprec_stream = StreamedModel(ckpt, model, path, blocks)
    return model


def _load_own(ckpt: Checkpoint, mod: nn.Module, name: str) -> None:
    """Load a module's own parameters (not its children's)."""
    for pname, p in list(mod._parameters.items()):
        if p is None:
            continue
        key = f"{name}.{pname}" if name else pname
        if key not in ckpt.weight_map:
            continue
        for _, value in ckpt._tensors([key]):
            if tuple(value.shape) != tuple(p.shape):
                raise ModelFileError(f"{ckpt.folder}: tensor {key!r} has shape "
                                     f"{tuple(value.shape)}, the config's model "
                                     f"{tuple(p.shape)}")
            swap_in(mod, pname, value)


def stream_of(model: nn.Module) -> StreamedModel | None:
    """The model's ``StreamedModel``, or None for a model held in memory."""
    return getattr(model, "autoprec_stream", None)


__all__ = ["REPLAY_BYTES", "Inject", "NotInShell", "StreamMemory", "StreamedModel", "find_blocks",
           "inputs_digest", "open_streamed", "stream_of"]
