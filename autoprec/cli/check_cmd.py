"""``autoprec check MODEL.py --policy P.yaml``: the pre-deployment gate (exit 1 on failure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from autoprec.cli import target_names
from autoprec.evaluation.json_fields import batch_size_words


def check_cmd(
    model: Annotated[Path, typer.Argument(help="model.py (build_model, calibration_data, …)")],
    policy: Annotated[Path, typer.Option(help="Policy file to gate.")],
    max_error: Annotated[float | None, typer.Option(help="Budget: relative L2 error of the outputs (default: the policy's budget).")] = None,
    max_drop: Annotated[float | None, typer.Option(help="Budget: drop of model.py's metric (default: the policy's budget).")] = None,
    target: Annotated[str | None, typer.Option(help=f"Target device profile: {target_names()} (default: the policy's).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Deployment batch size (default: the policy's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Accept a changed model fingerprint (noted, not failed).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    compile_mode: Annotated[bool | None, typer.Option("--compile/--eager", help="Price the plan as torch.compile (inductor) runs it, or op by op (default: the policy's target.mode, else eager).")] = None,
    min_headroom: Annotated[float | None, typer.Option(help="Fail when a 16-bit / fp8-family layer's largest value on calibration data is within this factor of its format's limit (e.g. 16).")] = None,
) -> None:
    """Re-evaluate POLICY on MODEL's eval data; exit 1 when over budget, when the model
    changed since tuning, or when the target cannot run a precision in the policy."""
    from autoprec.evaluation.check import check

    result = check(model, policy, max_error=max_error, max_drop=max_drop, force=force,
                   target=target, batch_size=batch_size, compile=compile_mode,
                   min_headroom=min_headroom)
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        result.raise_if_failed()  # exit 1 with the first reason on stderr
    else:
        _print(result.to_dict())  # the reasons, once, under FAILED
        if not result.passed:
            raise typer.Exit(1)


def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _print(d: dict[str, Any]) -> None:
    rows = d["layers"]
    if rows:
        w = max(len("layer"), *(len(r["layer"]) for r in rows))
        typer.echo(f"{'layer':<{w}}  {'kind':<10} {'precision':<9} {'computed':<9} "
                   f"{'target':<6} {'est_us':>9}  rule")
        for r in rows:
            typer.echo(f"{r['layer']:<{w}}  {r['kind']:<10} {r['precision']:<9} "
                       f"{_fmt(r['computed']):<9} {'ok' if r['supported'] else 'NO':<6} "
                       f"{_fmt(r['est_time_us'], '.2f'):>9}  {r['rule']}")
        typer.echo("")
    if d["budget_kind"] == "max_drop":
        measure = (f"metric drop {_fmt(d['metric_drop'])} (metric {_fmt(d['metric'])} vs "
                   f"fp32 {_fmt(d['fp32_metric'])})")
    else:
        measure = f"error {_fmt(d['error'])}"
    typer.echo(f"{measure}, budget {d['budget']:g} ({d['budget_source']}), on "
               f"{d['eval_batches']} eval batches")
    typer.echo(f"target {d['target'] or '-'} at "
               f"{batch_size_words(d['batch_size'], d['batch_size_from'])}: est. speed-up "
               f"{_fmt(d['est_speedup'], '.2f')}x; feasible: {str(d['feasible']).lower()}")
    low = min(d["headroom"], key=lambda r: r["headroom"] or float("inf"), default=None)
    if low is not None and low["headroom"] is not None:
        gate = f" (gate {d['min_headroom']:g}x)" if d["min_headroom"] is not None else ""
        typer.echo(f"headroom: least {low['headroom']:.3g}x at {low['layer']} ({low['precision']}"
                   f", max |x|, |y| {low['max_abs']:.3g} of {low['limit']:g}){gate}")
    for n in d["notes"]:
        typer.echo(f"note: {n}")
    if d["passed"]:
        typer.echo("PASSED")
    else:
        typer.echo("FAILED")
        for r in d["reasons"]:
            typer.echo(f"  - {r['reason']}")


def register(app: typer.Typer) -> None:
    app.command("check")(check_cmd)
