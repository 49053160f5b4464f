"""``autoprec graph MODEL.py``: the layer graph of a model, as a table or JSON."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any

import typer


def graph_cmd(
    model: Annotated[Path, typer.Argument(help="model.py (build_model, calibration_data, ...)")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the graph as JSON.")] = False,
    hooks_only: Annotated[
        bool, typer.Option("--hooks-only", help="Skip fx and torch.export (fastest tracer).")
    ] = False,
    export_timeout: Annotated[
        float, typer.Option(help="Seconds before torch.export is given up (0: no limit).")
    ] = 60.0,
) -> None:
    """Trace MODEL on its first calibration batch: every layer's kind, shapes, FLOPs and
    the precisions it may take (with the reason for the others)."""
    from autoprec.io.validate import check_seconds
    from autoprec.trace import TRACERS, trace
    from autoprec.workload.checkpoint_spec import load_model

    check_seconds(export_timeout, "--export-timeout", allow_zero=True)
    spec = load_model(model)
    net = spec.model()
    batch = spec.calibration_batches()[0]
    # A batch the model rejects is the user's error (exit 2), found before tracing.
    spec.run(net, batch, 0, "of calibration_data()")
    graph = trace(
        net,
        batch,
        forward=spec.forward,
        model_name=spec.name,
        tracers=("hooks",) if hooks_only else TRACERS,
        export_timeout=export_timeout or None,
    )
    if json_out:
        typer.echo(json.dumps(graph.to_json(), indent=2))
        return

    from autoprec.formats.precisions import PRECISIONS

    frame = graph.to_frame()
    every = ",".join(PRECISIONS)
    frame["allowed"] = ["all" if a == every else a for a in frame["allowed"]]
    for col in ("flops", "bytes"):
        frame[col] = [_si(v) for v in frame[col]]
    frame["why_not"] = [_why_not(n.disallowed) for n in graph]
    # a terminal gets lines that fit it; a pipe or a file gets every reason whole
    width = shutil.get_terminal_size((120, 24)).columns if sys.stdout.isatty() else None
    typer.echo(_fit(frame, width))
    gemms = graph.gemm_nodes
    typer.echo("")
    typer.echo(f"model: {graph.model_name}   fingerprint: {graph.fingerprint}")
    typer.echo(
        f"layers: {len(graph)}   GEMM layers: {len(gemms)}   "
        f"FLOPs/pass: {graph.total_flops:,} (batch size {graph.batch_size})   "
        f"params: {sum(n.params for n in graph):,}"
    )
    typer.echo(f"tracer: {graph.tracer}   data-flow edges: {len(graph.edges)}")
    for name, why in graph.fallbacks:
        typer.echo(f"  {name} failed: {why}")


def _si(value: object) -> str:
    """67108864 -> '67.1M' (FLOPs and bytes at a glance; --json has the exact figures)."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}"


def _fit(frame: Any, width: int | None) -> str:
    """The table within ``width`` columns: why_not is the last column, so a line too long
    is cut there with '…' (a narrow terminal still gets every layer; --json gives every
    reason whole)."""
    import pandas as pd

    width = max(width, 80) if width is not None else 10**9
    with pd.option_context("display.max_rows", None, "display.max_colwidth", 10_000,
                           "display.width", 10_000):  # fmt: skip
        rest = frame.drop(columns=["why_not"]).to_string(index=False).splitlines()
    # why_not left-aligned after the rest (pandas would right-align it)
    lines = [f"{a} {b}".rstrip() for a, b in zip(rest, ["why_not", *frame["why_not"]])]
    cut = [ln if len(ln) <= width else ln[: width - 1] + "…" for ln in lines]
    text = "\n".join(line.rstrip() for line in cut)
    if cut != lines:
        text += "\n(lines cut to the terminal's width: --json gives every reason)"
    return text


def _why_not(disallowed: dict[str, str]) -> str:
    """A non-GEMM layer's four reasons say one thing: show it once."""
    from autoprec.formats.precisions import PRECISIONS

    if set(disallowed) >= set(PRECISIONS) - {"fp32"}:
        return disallowed["bf16"]  # `allowed` says fp32; the one reason for the others
    return "; ".join(f"{k}: {v}" for k, v in disallowed.items())


def register(app: typer.Typer) -> None:
    app.command("graph")(graph_cmd)
