"""``autoprec save`` (a deployable checkpoint) and ``autoprec export-recipe`` (a training
plan as Transformer Engine or torchao spell it): thin wrappers over ``autoprec.export``."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Annotated

import typer

from autoprec.errors import InputError

_RECIPE_TARGETS = ("te", "torchao")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


@contextlib.contextmanager
def _quiet_libraries():
    """compressed-tensors and transformers print progress bars and info lines: hidden."""
    loggers = [logging.getLogger(n) for n in ("transformers", "compressed_tensors")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def save_cmd(
    model: Annotated[Path, typer.Argument(help="model.py whose build_model() returns a transformers model")],
    policy: Annotated[Path, typer.Option(help="Policy file to deploy.")],
    out: Annotated[Path, typer.Option(help="Folder to write the checkpoint to (config.json, *.safetensors).")],
    force: Annotated[bool, typer.Option("--force", help="Apply a policy whose model fingerprint does not match.")] = False,
) -> None:
    """Write MODEL deployed under POLICY as a compressed-tensors HF checkpoint that
    transformers' from_pretrained and vLLM load."""
    from autoprec.export.checkpoint import save_pretrained
    from autoprec.io.paths import check_out_dir
    from autoprec.policy import load_policy
    from autoprec.workload.checkpoint_spec import load_model

    check_out_dir(out)  # before any work: /proc, an existing file, a read-only folder
    spec = load_model(model)
    built = spec.model()
    pol = load_policy(policy, model=built, force=force)  # its warnings shown, not hidden
    batches = spec.calibration_batches()
    with _quiet_libraries():
        rep = save_pretrained(built, pol, out, calibration=batches, forward=spec.forward,
                              force=force)
    for fmt, layers in sorted(rep.groups.items()):
        typer.echo(f"{fmt}: {len(layers)} layers")
    typer.echo(f"ignored (unquantised): {len(rep.ignore)} layers; dtype {rep.dtype}")
    if rep.fused:
        typer.echo(f"fused groups, one scheme each: {len(rep.fused)}")
    typer.echo(f"weights: plan {_mb(rep.plan_bytes)}, checkpoint on disk {_mb(rep.disk_bytes)}")
    for g in rep.dtype_mixed:
        typer.echo(f"fused group in two dtypes (a fused runtime runs it in one): {g}")
    if rep.islands_note:
        typer.echo(f"islands: {rep.islands_note}")
    if rep.replaced:
        typer.echo(f"replaced the earlier save's weight files: {', '.join(rep.replaced)}")
    typer.echo(f"wrote {rep.out}")


def export_recipe_cmd(
    model: Annotated[Path, typer.Argument(help="model.py (build_model, …)")],
    policy: Annotated[Path, typer.Option(help="Policy file (a training plan).")],
    to: Annotated[str, typer.Option("--to", help="te (Transformer Engine CustomRecipe) or torchao (float8 module_filter_fn).")],
    out: Annotated[Path, typer.Option(help="Python file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Accept a policy whose model fingerprint does not match.")] = False,
) -> None:
    """Write POLICY's training plan as Python a training script imports: a Transformer
    Engine CustomRecipe, or a torchao float8 module_filter_fn."""
    from autoprec.export.recipes import te_recipe_source, torchao_filter_source
    from autoprec.io.fileio import atomic_write
    from autoprec.workload.checkpoint_spec import load_model

    if to not in _RECIPE_TARGETS:
        raise InputError(f"--to must be one of {', '.join(_RECIPE_TARGETS)}, got {to!r}")
    built = load_model(model).model()
    source = (te_recipe_source if to == "te" else torchao_filter_source)(policy, built, force)
    atomic_write(out, source)
    typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("save")(save_cmd)
    app.command("export-recipe")(export_recipe_cmd)
