"""``autoprec probe MODEL.py``: per layer × precision sensitivity, ranked, with reasons."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from autoprec.errors import InputError
from autoprec.formats.precisions import parse_precisions
from autoprec.io.fileio import atomic_write, brief
from autoprec.io.paths import check_dir, check_not_an_input, check_out_path

#: What the printed table shows (the CSV / JSON carry every column).
_SHOWN = ["layer", "precision", "local_error", "cheap_estimate", "e2e_error", "max_abs",
          "overflow", "underflow_frac", "nonfinite", "reason"]


def probe_cmd(
    model: Annotated[Path, typer.Argument(help="model.py (build_model, calibration_data, …)")],
    precisions: Annotated[str | None, typer.Option(help="Comma list, e.g. fp16,bf16,fp8 (default: all this device runs).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the full table as CSV.")] = None,
    e2e: Annotated[str, typer.Option(help="End-to-end runs: auto (where the estimate is near the budget), all, none.")] = "auto",
    max_error: Annotated[float | None, typer.Option(help="Budget the reasons compare with: relative L2 output error (default 0.01).")] = None,
    max_drop: Annotated[float | None, typer.Option(help="Budget as a drop of model.py's metric (e2e_error becomes the drop).")] = None,
    layer: Annotated[list[str] | None, typer.Option(help="Probe only this module path (repeatable).")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Reuse / store results here (keyed by model, weights, data, options).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Probe MODEL's GEMM layers in each precision: local error, range (overflow /
    underflow), a cheap end-to-end estimate and, where it matters, the measured one."""
    from autoprec.io.validate import check_budget
    from autoprec.probe import probe
    from autoprec.workload.checkpoint_spec import load_model
    from autoprec.workload.scoring import reference

    precs = parse_precisions(precisions)  # a bad name: InputError, exit 2
    if e2e not in ("auto", "all", "none"):
        raise InputError(f"--e2e: expected auto, all or none, got {brief(e2e)}")
    if max_error is not None and max_drop is not None:
        raise InputError("--max-error and --max-drop are exclusive: give one budget")
    check_budget(max_error, max_drop)
    if out is not None:
        check_out_path(out)  # before the probes run
        check_not_an_input(out, {"the model file": model})
    if cache_dir is not None:
        check_dir(cache_dir, "--cache-dir")
    spec = load_model(model)
    if max_drop is not None and spec.metric is None:
        raise InputError(f"{spec.where}: --max-drop needs a metric(outputs, batch) in model.py")
    net = spec.model()
    batches = spec.calibration_batches()
    # The fp32 reference, as tune computes it: a batch the model rejects, a forward with no
    # floating output, a non-finite output or metric is the user's error (exit 2), found
    # before probing (the probes would otherwise blame every layer).
    used = spec if max_drop is not None else dataclasses.replace(spec, metric=None)
    reference(used, net, batches, "of calibration_data()")
    table = probe(
        net, batches, precs, forward=spec.forward, loss=spec.loss,
        metric=spec.metric if max_drop is not None else None, e2e=e2e, layers=layer,
        budget=max_drop if max_drop is not None else max_error, cache_dir=cache_dir,
        progress=not quiet and not json_out,
    )
    if out is not None:  # atomic: a reader never sees half a table
        atomic_write(out, table.to_frame().to_csv(index=False))
    if json_out:
        doc = table.to_json()
        doc["model"] = spec.name
        typer.echo(json.dumps(doc, indent=2))
        return
    _print(spec.name, table, out, default_budget=max_error is None and max_drop is None)


def _print(name: str, table: Any, out: Path | None, default_budget: bool = False) -> None:
    import pandas as pd

    frame = table.ranked()[_SHOWN].copy()
    if default_budget:  # no budget was given: the reasons compare with the default one
        frame["reason"] = frame["reason"].str.replace("> budget ", "> default budget ",
                                                      regex=False)
    fmt = {c: _num for c in ("local_error", "cheap_estimate", "e2e_error", "max_abs")}
    fmt["underflow_frac"] = lambda v: f"{v:.0%}" if v >= 0.005 else ("<1%" if v else "0")
    with pd.option_context("display.max_rows", None, "display.max_colwidth", 100,
                           "display.width", 250):  # fmt: skip
        typer.echo(frame.to_string(index=False, formatters=fmt, na_rep="-"))
    meta = table.meta
    cost = meta.get("cost_total", math.nan)
    naive = meta.get("cost_naive", math.nan)
    typer.echo("")
    budget = (f"{meta.get('budget')} ({meta.get('units')}; the default, --max-error E or "
              "--max-drop D to set one)" if default_budget
              else f"{meta.get('budget')} ({meta.get('units')})")
    typer.echo(
        f"model: {name}   layers: {meta.get('layers')}   precisions: "
        f"{','.join(meta.get('precisions', []))}   budget: {budget}   hard exclusions: "
        f"{len(table.hard_excluded())}"
    )
    if frame["e2e_error"].isna().any():
        typer.echo("e2e_error '-': not measured. The end-to-end error is run only where the "
                   "cheap estimate (local errors carried to the output by one backward) is "
                   "near the budget (--e2e auto); --e2e all measures every row.")
    typer.echo(
        f"cost: {cost:.1f} forward-pass equivalents ({meta.get('e2e_runs')} end-to-end runs) "
        f"vs {naive:.0f} one layer at a time; {meta.get('seconds', 0):.1f}s"
        + ("  (cached)" if meta.get("cached") else "")
    )
    if out is not None:
        typer.echo(f"table: {out}")


def _num(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f"{v:.3g}"


def register(app: typer.Typer) -> None:
    app.command("probe")(probe_cmd)
