"""A deployed plan as an HF checkpoint in the compressed-tensors format (what vLLM serves and
``transformers`` loads).

``save_pretrained(model, policy, out)`` applies the policy in the deploy form to a copy of
the model, reads back the tensors the applied plan computes with, and hands them to the
``compressed-tensors`` library to write (no hand-written serialiser):

- each GEMM-format layer becomes a target of its format's config group (``schemes``): its
  weight is the deploy form's quantised elements, its scales the same numbers in
  compressed-tensors' convention (``x = q * scale``; autoprec stores ``x = q / scale`` for
  fp8, so the written scale is its reciprocal); fp8 activations dynamic per tensor, as
  autoprec quantises them per call;
- every other GEMM leaf is listed in ``ignore``, and every unquantised tensor is stored in
  its region's dtype (bf16 layers bf16, fp32 islands fp32); ``config.json``'s ``dtype`` is
  the default region's.

What ``transformers`` does with the islands: it loads every unquantised weight in the
checkpoint's one dtype, so an fp32 island comes back in the default region's dtype. The
report names them in one line (``CheckpointReport.islands_note``); ``keep_islands``
(``autoprec.export.load``) puts their fp32 weights back after loading.

What vLLM would reject is refused here (``ExportRefused``, exit 2): a fused group (q/k/v,
gate/up, an MoE layer's experts; ``trace.fused_groups``) whose members have different
schemes (a quantised format beside another, or beside an unquantised dtype), and a GEMM
format on a layer compressed-tensors does not compress (not an ``nn.Linear``). A group
whose members are unquantised in different dtypes (bf16 beside fp32) loads, but a fused
runtime runs it in one dtype: the report names it (``dtype_mixed``).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import InputError, OutputError
from autoprec.export.schemes import CT_FORMAT, STATIC_ACTIVATION_SCALE, ct_scales, scheme_for
from autoprec.formats.gemm import is_gemm_module
from autoprec.formats.precisions import STORAGE_DTYPES, is_gemm_format
from autoprec.io.extras import require
from autoprec.policy import Policy, load_policy
from autoprec.trace.fused_groups import FusedGroup, fused_groups

#: The key under config.json that records which policy made the checkpoint.
AUTOPREC_KEY = "autoprec"


class ExportRefused(InputError):
    """The plan cannot be written as a checkpoint a serving runtime loads (exit 2)."""


@dataclass
class CheckpointReport:
    """What ``save_pretrained`` wrote: the folder, each format's layers, the ``ignore``
    list, the fp32 islands, the plan's weight bytes and the checkpoint's bytes on disk."""

    out: Path
    groups: dict[str, list[str]]
    ignore: list[str]
    islands: dict[str, str]  # module path -> its stored dtype (another than config's)
    dtype: str  # config.json's dtype: the default region's storage dtype
    plan_bytes: int  # the applied plan's weights (autoprec's stored tensors)
    disk_bytes: int  # the *.safetensors files written
    fused: list[FusedGroup] = field(default_factory=list)
    #: fused groups whose members are unquantised in different dtypes: a fused runtime
    #: (vLLM) runs them as one GEMM in one dtype; transformers keeps them apart
    dtype_mixed: list[str] = field(default_factory=list)
    #: weight files of an earlier save in the folder, replaced by this one
    replaced: list[str] = field(default_factory=list)

    @property
    def islands_note(self) -> str | None:
        """One line naming the layers ``transformers`` will not load in their precision."""
        if not self.islands:
            return None
        names = ", ".join(f"{p} ({d})" for p, d in self.islands.items())
        return (f"stored in their own dtype, loaded by transformers in {self.dtype} (the "
                f"checkpoint's one dtype): {names}; autoprec.export.keep_islands(model, "
                f"'{self.out}') puts them back")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from autoprec.io.paths import unwrap_model

    return unwrap_model(model)


def _leaves(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {p: m for p, m in model.named_modules()
            if p and is_gemm_module(m) and not any(True for _ in m.children())}


def _scheme_name(precision: str) -> str:
    """What a runtime sees of a layer: its GEMM format, or "unquantized" (a dtype)."""
    return precision if is_gemm_format(precision) else "unquantized"


def check_exportable(model: torch.nn.Module, precision_of: dict[str, str],
                     groups: Iterable[FusedGroup]) -> None:
    """Raise ExportRefused for what a fused runtime cannot load: a fused group mixing
    schemes, a GEMM format on a module compressed-tensors cannot compress."""
    mods = dict(model.named_modules())
    for path, prec in precision_of.items():
        if is_gemm_format(prec) and not isinstance(mods[path], torch.nn.Linear):
            raise ExportRefused(
                f"{path}: {prec} on a {type(mods[path]).__name__}: compressed-tensors "
                "quantises torch.nn.Linear layers only; give it a 16-bit or fp32 precision")
    for g in groups:
        schemes = {m: _scheme_name(precision_of.get(m, "fp32")) for m in g.members}
        if len(set(schemes.values())) > 1:
            shown = ", ".join(f"{m}: {precision_of.get(m, 'fp32')}" for m in g.members)
            raise ExportRefused(
                f"{g.describe()} runs as one GEMM in vLLM and other fused runtimes, which "
                f"need one scheme for all of it, but the plan mixes them ({shown}); tune "
                "with --fuse-groups auto or give the group one precision")


def _as_policy(policy: Policy | str | Path, model: torch.nn.Module, force: bool) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, Path)):
        return load_policy(policy, model=model, force=force)
    raise InputError(f"save_pretrained: policy must be a Policy or a path, got "
                     f"{type(policy).__name__}")


def _deployed(work: torch.nn.Module, policy: Policy, force: bool,
              run_batches: Callable[[torch.nn.Module], None] | None,
              static_paths: list[str]
              ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float], int]:
    """The deploy form's tensors of every module (path -> {name: tensor}), the input amax
    over the calibration batches of each layer whose scheme has a static activation scale,
    and the plan's weight bytes."""
    from autoprec.apply.apply import apply_policy

    handle = apply_policy(work, policy, fp8_backend="emulated", form="deploy", force=force,
                          guard="off")
    amax: dict[str, float] = {}
    try:
        plan_bytes = handle.weight_bytes()
        tensors = {path: {**{n: t for n, t in mod._parameters.items() if t is not None},
                          **{n: t for n, t in mod._buffers.items() if t is not None}}
                   for path, mod in work.named_modules()}
        if static_paths and run_batches is not None:
            mods = dict(work.named_modules())
            hooks = []

            def record(path: str) -> Callable[..., None]:
                def hook(_m: torch.nn.Module, args: tuple[Any, ...]) -> None:
                    a = float(args[0].detach().float().abs().amax())
                    amax[path] = max(amax.get(path, 0.0), a)
                return hook

            for p in static_paths:
                hooks.append(mods[p].register_forward_pre_hook(record(p)))
            try:
                with torch.no_grad():
                    run_batches(work)
            finally:
                for h in hooks:
                    h.remove()
    finally:
        handle.remove()
    return tensors, amax, plan_bytes


def _install(work: torch.nn.Module, tensors: dict[str, dict[str, torch.Tensor]],
             formats: dict[str, str]) -> None:
    """Put the deployed tensors on ``work``'s modules; a GEMM-format layer's weight as its
    fp32 dequantised values (compressed-tensors quantises them back to the same elements
    with the scales ``ct_scales`` gives), its autoprec scale buffers left out."""
    from autoprec.lower.stored import SCALE, SCALE_2

    for path, mod in work.named_modules():
        own = tensors.get(path, {})
        fmt = formats.get(path)
        for name, t in own.items():
            if fmt is not None and name in (SCALE, SCALE_2):
                continue
            if fmt is not None and name == "weight":
                continue  # set from ct_scales below
            if name in mod._parameters:
                mod._parameters[name] = (t if isinstance(t, torch.nn.Parameter)
                                         else torch.nn.Parameter(t, requires_grad=False))
            elif name in mod._buffers:
                mod._buffers[name] = t


def save_pretrained(model: torch.nn.Module, policy: Policy | str | Path, out: str | Path, *,
                    calibration: Iterable[Any] = (),
                    forward: Callable[[torch.nn.Module, Any], Any] | None = None,
                    force: bool = False) -> CheckpointReport:
    """Write ``model`` deployed under ``policy`` to ``out`` as a compressed-tensors HF
    checkpoint (module doc). ``model``: a transformers ``PreTrainedModel`` (fp32 or the
    16-bit model the policy was tuned on; it is not changed). ``calibration``: batches run
    through the applied plan (with ``forward``, default ``model(batch)`` /
    ``model(*batch)`` / ``model(**batch)``) to find fused groups from the graph and, for
    nvfp4 layers, the static activation tensor scale compressed-tensors' NVFP4 scheme
    needs. Raises ExportRefused / InputError / MissingExtra (exit 2)."""
    from autoprec.io.paths import check_out_dir

    outdir = check_out_dir(Path(out), "save_pretrained: out")  # before any work
    require("compressed_tensors", "autoprec save (a compressed-tensors checkpoint)")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )

    from autoprec.workload.loading import check_has_data, default_forward

    root = _unwrap(model)
    check_has_data(root, "save_pretrained: model")  # a meta (offloaded) weight: one line
    if not (hasattr(root, "save_pretrained") and hasattr(root, "config")):
        raise InputError(f"save_pretrained needs a transformers PreTrainedModel (with "
                         f".config and .save_pretrained), got {type(root).__name__}")
    pol = _as_policy(policy, root, force)
    batches = list(calibration)
    fwd = forward or default_forward
    stream = getattr(root, "autoprec_stream", None)
    work = _whole(stream) if stream is not None else copy.deepcopy(root).eval()

    from autoprec.plan import compile_plan

    plan = compile_plan(pol, work)
    leaves = _leaves(work)
    precision_of = plan.assignment(leaves)
    groups = fused_groups(work, (lambda: fwd(work, batches[0])) if batches else None)
    check_exportable(work, precision_of, groups)
    dtype_mixed = [f"{g.describe()}: " + ", ".join(f"{m.rpartition('.')[2]} "
                                                   f"{precision_of.get(m, 'fp32')}"
                                                   for m in g.members)
                   for g in groups
                   if len({precision_of.get(m, "fp32") for m in g.members}) > 1]
    formats = {p: f for p, f in precision_of.items() if is_gemm_format(f)}
    static = [p for p, f in formats.items() if STATIC_ACTIVATION_SCALE[f]]
    if static and not batches:
        raise InputError(f"{static[0]}: {formats[static[0]]} layers need calibration "
                         "batches: compressed-tensors' scheme has a static activation scale "
                         "(input_global_scale), measured on them")

    def run_all(m: torch.nn.Module) -> None:
        for b in batches:
            fwd(m, b)

    tensors, amax, plan_bytes = _deployed(work, pol, force, run_all, static)
    resolution = plan.resolution()
    dtype = STORAGE_DTYPES[resolution[""].precision]
    _install(work, tensors, formats)

    # one config group per format, the layer names as targets; every other GEMM leaf ignored
    by_format: dict[str, list[str]] = {}
    for p, f in formats.items():
        by_format.setdefault(f, []).append(p)
    ignore = [p for p in leaves if p not in formats]
    qconfig = QuantizationConfig(
        config_groups={f"group_{i}": scheme_for(f, paths)
                       for i, (f, paths) in enumerate(sorted(by_format.items()))},
        ignore=ignore, quantization_status=QuantizationStatus.FROZEN)
    mods = dict(work.named_modules())
    for p, f in formats.items():  # dequantised fp32 weights before the scales exist
        values, _ = ct_scales(tensors[p], f, amax.get(p))
        mods[p]._parameters["weight"] = torch.nn.Parameter(values, requires_grad=False)
    if formats:
        apply_quantization_config(work, qconfig, show_progress=False)
        for p, f in formats.items():
            _, scales = ct_scales(tensors[p], f, amax.get(p))
            for name, value in scales.items():
                param = getattr(mods[p], name)
                param.data = value.to(param.dtype).reshape(param.shape)
    islands = {p: str(own["weight"].dtype).replace("torch.", "")
               for p, own in tensors.items() if p not in formats and "weight" in own
               and own["weight"].is_floating_point() and own["weight"].dtype != dtype}
    work.config.dtype = dtype
    extra = {"policy": pol.source, "default": pol.default, "form": "deploy",
             "islands": islands, "fused_groups": [list(g.members) for g in groups]}
    setattr(work.config, AUTOPREC_KEY, extra)
    try:  # checked up front; a disk that fills meanwhile is still one line
        outdir.mkdir(parents=True, exist_ok=True)
        with _replacing_weights(outdir) as replaced:
            if formats:
                compressor = ModelCompressor.from_pretrained_model(work)
                compressor.compress_model(work)
                compressor.remove_decompression_hook(work)
                work.save_pretrained(outdir)
                compressor.update_config(str(outdir))
            else:
                work.save_pretrained(outdir)
    except OSError as err:
        raise OutputError(f"{outdir}: cannot write the checkpoint: "
                          f"{err.strerror or err}") from None
    disk = sum(os.path.getsize(f) for f in outdir.glob("*.safetensors"))
    return CheckpointReport(out=outdir, groups=by_format, ignore=ignore, islands=islands,
                            dtype=str(dtype).replace("torch.", ""), plan_bytes=plan_bytes,
                            disk_bytes=disk, fused=groups, dtype_mixed=dtype_mixed,
                            replaced=replaced)


def _whole(stream: Any) -> torch.nn.Module:
    """The streamed model's checkpoint loaded whole by transformers (``from_pretrained``),
    in the dtype it was streamed in: the deploy form rewrites every weight, so the save
    holds the model once and its deployed tensors beside it. InputError when that does not
    fit in the host's available memory (writing a checkpoint block by block is not done)."""
    from transformers import AutoModelForCausalLM

    from autoprec.tuning.memory import available_bytes, gb

    ckpt = stream.ckpt
    need = 2 * ckpt.bytes_under("", held=True)
    free = available_bytes()
    if free is not None and need > free:
        raise InputError(f"{ckpt.folder}: autoprec save holds the model and its deployed "
                         f"weights ({gb(need)}), more than the {gb(free)} available; a "
                         "checkpoint larger than memory is not saved block by block")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt.folder),
                                                 dtype=ckpt.load_dtype or ckpt.dtype())
    model.config.use_cache = False
    return model.eval()


#: the weight files ``save_pretrained`` writes: ``model.safetensors``, its shards
#: (``model-00001-of-00003.safetensors``) and their index
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


@contextlib.contextmanager
def _replacing_weights(folder: Path) -> Iterator[list[str]]:
    """An earlier save's weight files are set aside while the new one is written, then
    removed (their names yielded); put back if the write fails. Left in place, a single
    ``model.safetensors`` beside new shards is what ``from_pretrained`` loads (it prefers
    the single file), and a larger earlier save's shards are read by anything that globs
    ``*.safetensors``. The folder's other files are the user's and stay."""
    old = sorted(f.name for f in folder.iterdir()
                 if f.is_file() and _WEIGHT_FILE.fullmatch(f.name))
    aside = Path(tempfile.mkdtemp(prefix=".autoprec-replaced-", dir=folder)) if old else None
    for name in old:
        os.replace(folder / name, aside / name)  # type: ignore[operator]
    try:
        yield old
    except BaseException:
        for name in old:  # what the failed write left under an old name goes
            os.replace(aside / name, folder / name)  # type: ignore[operator]
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


__all__ = ["AUTOPREC_KEY", "CT_FORMAT", "CheckpointReport", "ExportRefused",
           "check_exportable", "save_pretrained"]
