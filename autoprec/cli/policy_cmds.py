"""``autoprec show P.yaml`` and ``autoprec eval MODEL.py --policy P.yaml``.

``show`` prints a policy for review: its rules with their reasons, metrics, provenance.
``eval`` applies a policy to the model of model.py, measures its error (or metric drop)
against fp32 on the eval data, audits what every GEMM computed in, and prices the
assignment on the target with the cost model.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from autoprec.cli import target_names
from autoprec.errors import CheckFailed


@contextmanager
def _warnings_to_stderr(reword: Any = None) -> Iterator[None]:
    """Library warnings as one ``autoprec: warning:`` line each, duplicates once;
    ``reword(message)``: the line to print instead (None: as it is)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            seen: set[str] = set()
            for w in caught:
                msg = str(w.message) if reword is None else reword(str(w.message))
                if msg not in seen and issubclass(w.category, UserWarning):
                    seen.add(msg)
                    print(f"autoprec: warning: {msg}", file=sys.stderr)


def _table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r]
                                           for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


# -- show ---------------------------------------------------------------------------------

def show_cmd(
    policy: Annotated[Path, typer.Argument(help="Policy file (YAML, schema 1).")],
    model: Annotated[Path | None, typer.Option(
        "--model", help="model.py: list the rules in the model's module order and check "
                        "that every path exists (default: the order of the file).")] = None,
) -> None:
    """Print a policy for review: rules, reasons, metrics, provenance.

    Rules are listed in the file's order (tune writes them in model order); with --model
    in the order of the model's named_modules().
    """
    from autoprec.policy import load_policy
    from autoprec.policy.modules import FORCED

    # show lists a mismatched policy for review: it applies nothing, and nothing was forced
    reviewed = "; listed for review (eval, check and apply refuse it unless forced: --force)"
    with _warnings_to_stderr(lambda m: m.replace(FORCED, reviewed)):
        if model is None:
            pol = load_policy(policy)
            order: dict[str, int] = {}
        else:
            from autoprec.workload.checkpoint_spec import load_model

            net = load_model(model).model()
            pol = load_policy(policy, model=net, force=True)  # review: a mismatch is a warning
            order = {name: i for i, name in enumerate(n for n, _ in net.named_modules())}
    typer.echo(f"policy: {policy}  (schema 1)")
    if pol.model:
        typer.echo(f"model: {pol.model_name or '-'}   fingerprint: {pol.fingerprint or '-'}")
    else:
        typer.echo("model: - (no fingerprint: not checked against the model's structure)")
    if pol.target:
        bs = f", batch size {pol.batch_size}" if pol.batch_size else ""
        mode = ", torch.compile" if pol.mode == "compile" else ""
        typer.echo(f"target: {pol.target_device or '-'}{bs}{mode}")
    typer.echo(f"default: {pol.default}")
    paths = show_order(pol, order)
    if paths:
        rows = [(p or "<root>", pol.layers.get(p, f"({pol.default})"),
                 "yes" if p in pol.locked else "", pol.reasons.get(p, "")) for p in paths]
        typer.echo("")
        typer.echo(_table(rows, ("layer", "precision", "locked", "reason")))
    else:
        typer.echo("layers: none (everything runs in the default)")
    counts = {p: sum(1 for v in pol.layers.values() if v == p) for p in pol.precisions}
    typer.echo("")
    typer.echo("rules: " + (", ".join(f"{n} {p}" for p, n in counts.items() if n) or "0"))
    if pol.metrics:
        typer.echo("metrics: " + ", ".join(f"{k} {_fmt(v)}" for k, v in pol.metrics.items()))
    if pol.provenance:
        typer.echo("provenance: " + ", ".join(f"{k} {_fmt(v)}"
                                              for k, v in pol.provenance.items()))


def show_order(pol: Any, order: dict[str, int] | None = None) -> list[str]:
    """Every path ``show`` lists: rules in file order, then locked and reasoned paths not
    ruled on; with ``order`` (module path -> index in ``named_modules()``) in model order,
    ties kept in file order."""
    paths = list(dict.fromkeys([*pol.layers, *pol.locked, *pol.reasons]))
    if order:
        paths.sort(key=lambda p: order.get(p, len(order)))
    return paths


# -- eval ---------------------------------------------------------------------------------

def eval_cmd(
    model: Annotated[Path, typer.Argument(help="model.py (build_model, calibration_data, ...)")],
    policy: Annotated[Path, typer.Option("--policy", help="Policy file to apply.")],
    target: Annotated[str | None, typer.Option(
        help=f"Target device profile for est_speedup: {target_names()} (default: the policy's, else h100).")] = None,
    batch_size: Annotated[int | None, typer.Option(
        help="Deployment batch size the speed is priced at (default: the policy's, else the "
             "calibration batch's).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Apply a policy whose model fingerprint does not match.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    measure: Annotated[bool, typer.Option(
        "--measure", help="When the target is this machine (cpu, or the GPU here): calibrate "
                          "its profile here if not cached, and time the policy beside fp32 "
                          "and one global autocast (interleaved rounds).")] = False,
    compile_mode: Annotated[bool | None, typer.Option(
        "--compile/--eager", help="Price the plan as torch.compile (inductor) runs it, or op "
                                  "by op (default: the policy's target.mode, else eager).")] = None,
) -> None:
    """Apply POLICY to MODEL: error vs fp32 on the eval data, per-layer precisions
    (rule vs computed), and the estimated speed-up on the target."""
    from autoprec.evaluation.eval_report import eval_report

    with _warnings_to_stderr():
        summary = eval_report(model, policy, target=target, batch_size=batch_size,
                              force=force, measure=measure, compile=compile_mode)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    if summary["audit_errors"]:
        raise CheckFailed(summary["audit_errors"][0] + (
            f" (and {len(summary['audit_errors']) - 1} more)"
            if len(summary["audit_errors"]) > 1 else ""))


def _print_summary(s: dict[str, Any]) -> None:
    from autoprec.cost.model import PARTS
    from autoprec.evaluation.json_fields import batch_size_words
    from autoprec.evaluation.rows import format_rows

    rows = [(r["layer"], r["rule"], r["precision"], r["computed"],
             "" if r["ok"] else "MISMATCH",
             "" if r["est_time_us"] is None else f"{r['est_time_us']:.2f}")
            for r in s["layers"]]
    typer.echo(_table(rows, ("layer", "rule", "precision", "computed", "audit",
                             f"est_us@{s['target']}")))
    typer.echo("")
    what = (f"metric drop {_fmt(s['metric_drop'])} (metric {_fmt(s['metric'])})"
            if "metric_drop" in s else f"error {_fmt(s['error'])}")
    budget = "no budget recorded" if s["budget"] is None else f"budget {_fmt(s['budget'])}"
    est = "-" if s["est_speedup"] is None else f"{s['est_speedup']:.2f}x"
    feasible = "unknown (no budget)" if s["feasible"] is None else str(s["feasible"]).lower()
    typer.echo(f"{what} vs fp32 on the eval data ({budget}); est. speed-up "
               f"{est} on {s['target']} at "
               f"{batch_size_words(s['batch_size'], s['batch_size_from'])}; "
               f"feasible: {feasible}")
    b = s["breakdown"]
    total = b["total_us"] or 1.0
    if "forward_us" in b:  # the training form: the whole step (cost.step)
        from autoprec.cost.step import STEP_PARTS

        typer.echo("est. training step: " + ", ".join(
            f"{k} {b[k + '_us'] / total:.0%}" for k in STEP_PARTS)
            + f" of {total:.1f} us (forward {b['forward_us']:.1f}, backward "
              f"{b['backward_us']:.1f}); {b['casts']} casts + {b['weight_casts']} weight "
              f"casts per forward, {b['backward_casts']} in the backward")
        if "memory" in b:
            m = b["memory"]
            typer.echo(f"est. training memory: peak {m['peak_mb']:.1f} MB = weights "
                       f"{m['weights_mb']:.1f} + grads {m['grads_mb']:.1f} + optimizer "
                       f"{m['optimizer_mb']:.1f} + saved activations {m['activations_mb']:.1f}")
    else:
        typer.echo("est. forward: " + ", ".join(
            f"{k} {b[k + '_us'] / total:.0%}" for k in PARTS)
            + f" of {total:.1f} us; {b['casts']} casts + {b['weight_casts']} weight casts "
              f"per forward, {b['kernels']} kernels")
    if s["fp8_backend"]:
        typer.echo(f"fp8 backend: {s['fp8_backend']}")
    rooms = [r for r in s["headroom"] if isinstance(r["headroom"], float)]
    for r in sorted(rooms, key=lambda r: r["headroom"])[:3]:  # the three closest to a limit
        typer.echo(f"headroom {r['layer']} ({r['precision']}): {r['headroom']:.3g}x (max |x|, "
                   f"|y| {r['max_abs']:.3g} of {r['format']}'s {r['limit']:g}, calibration)")
    b = s["baselines"]
    typer.echo("")
    typer.echo(format_rows(b))
    where = (f"measured on {b['measured_on']} at batch size {b['measured_batch_size']} "
             f"({b['timing']}, {b['rounds']} interleaved rounds)" if b["measured_on"]
             else "estimated")
    typer.echo(f"speed: {where}; {b['reason']}")
    typer.echo(f"pick: {b['recommendation']}")
    for why in s["infeasible"]:
        typer.echo(f"infeasible on {s['target']}: {why}")
    for r in s["layers"]:
        if r.get("reason"):
            typer.echo(f"reason {r['layer']}: {r['reason']}")


def register(app: typer.Typer) -> None:
    app.command("show")(show_cmd)
    app.command("eval")(eval_cmd)
