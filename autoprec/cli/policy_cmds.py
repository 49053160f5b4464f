"""``autoprec show P.yaml`` and ``autoprec eval MODEL.py --policy P.yaml``.

``show`` prints a policy for review: its rules with their reasons, metrics, provenance.
``eval`` applies a policy to the model of model.py, measures its error (or metric drop)
against fp32 on the eval data, audits what every GEMM computed in, and prices the
assignment on the target with the cost model.
"""

from __future__ import annotations

import json
import math
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
def _warnings_to_stderr() -> Iterator[None]:
    """Library warnings as one ``autoprec: warning:`` line each, duplicates once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            seen: set[str] = set()
            for w in caught:
                msg = str(w.message)
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


def _num(x: Any) -> Any:
    """JSON has no inf/nan: those become strings, as in tune's output."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else "-inf" if x < 0 else "nan"
    return x


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

    with _warnings_to_stderr():
        if model is None:
            pol = load_policy(policy)
            order: dict[str, int] = {}
        else:
            from autoprec.loading import load_model_file

            net = load_model_file(model).model()
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
    with _warnings_to_stderr():
        summary = evaluate_policy(model, policy, target=target, batch_size=batch_size,
                                  force=force, measure=measure, compile=compile_mode)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    if summary["audit_errors"]:
        raise CheckFailed(summary["audit_errors"][0] + (
            f" (and {len(summary['audit_errors']) - 1} more)"
            if len(summary["audit_errors"]) > 1 else ""))


def evaluate_policy(model: Path, policy_path: Path, target: str | None = None,
                    batch_size: int | None = None, force: bool = False,
                    measure: bool = False, compile: bool | None = None) -> dict[str, Any]:
    """What ``eval --json`` prints: score, audit and cost of a policy on model.py."""

    from autoprec.assess import assess
    from autoprec.loading import load_model_file
    from autoprec.policy import load_policy
    from autoprec.report_json import batch_size_from, reasons_json, speedup, verdict_reasons
    from autoprec.report_json import feasible as feasible_rule
    from autoprec.search.target import resolve_target
    from autoprec.validate import check_batch_size

    check_batch_size(batch_size)  # autoprec.validate: [1, MAX_BATCH_SIZE]
    spec = load_model_file(model)
    net = spec.model()
    pol = load_policy(policy_path, model=net, force=force)
    # the target resolved once, as check and tune resolve it: a local target priced on this
    # machine's calibration and op timings (a profile fitted on another CPU promised 1.82x
    # for a policy that ran 0.56x here)
    resolved = resolve_target(target, pol, compile=compile, measure=measure,
                              policy_path=policy_path)
    device, mode, source, profile = (resolved.name, resolved.mode, resolved.speed,
                                     resolved.profile)
    # score, audit and price: the pipeline check shares (autoprec/assess.py)
    a = assess(spec, net, pol, target=device, profile=profile, batch_size=batch_size,
               mode=mode, force=force, source=source)
    sc, ref, report, cost, bd = a.score, a.reference, a.audit, a.cost, a.breakdown
    batches, calib0, graph, bs = spec.eval_batches(), spec.calibration_batches()[0], \
        a.graph, a.batch_size
    fp8_backend, est, infeasible, times = a.fp8_backend, a.est_speedup, a.infeasible, \
        bd.by_module
    planned_casts = a.planned_casts
    warns = list(report.warnings)
    if report.casts != planned_casts:  # e.g. dtype-dependent model code, or another batch
        warns.append(f"the audited forward ran {report.casts} casts, the plan prices "
                     f"{planned_casts}")
    use_drop = sc.metric_drop is not None
    value = sc.value
    budget = pol.metrics.get("budget")
    within = None if budget is None else bool(value <= float(budget))
    feasible = feasible_rule(value, budget, runnable=not infeasible, audit_ok=report.ok)
    why_not = verdict_reasons(value, budget, name="metric drop" if use_drop else "error",
                              infeasible=infeasible, audit=report)
    layers = []
    rooms = {h.layer: h.to_dict()["headroom"] for h in a.headroom}
    for row in report.rows:
        t = times.get(row.layer)
        layers.append({"layer": row.layer, "rule": row.rule, "precision": row.expected,
                       "computed": row.computed, "ok": row.ok,
                       "est_time_us": None if t is None else round(t * 1e6, 4),
                       "headroom": rooms.get(row.layer),
                       "reason": pol.reasons.get(row.layer)})
    out: dict[str, Any] = {
        "model": spec.name, "policy": str(policy_path),
        "error": _num(sc.error),
    }
    if use_drop:
        out["metric"] = _num(sc.metric)
        out["metric_drop"] = _num(sc.metric_drop)
    out.update({
        "budget": budget, "within_budget": within,
        "est_speedup": speedup(est, runnable=not infeasible), "feasible": feasible,
        "target": device, "batch_size": bs,
        "batch_size_from": batch_size_from(batch_size, pol.batch_size), "mode": mode,
        "form": pol.form, "weight_bytes": cost.weight_bytes(pol),
        "breakdown": {**bd.to_dict(), "audited_casts": report.casts},
        "fp8_backend": fp8_backend,
        "reasons": reasons_json(why_not),
        "infeasible": infeasible,
        "audit_errors": report.errors,
        "headroom": [{k: _num(v) for k, v in h.to_dict().items()} for h in a.headroom],
        "guard": pol.guard.to_yaml(),
        "warnings": warns,
        "layers": layers,
    })
    speed = _beside_baselines(spec, net, pol, batches, ref, sc.value, budget, cost, graph,
                              calib0, device, source, measure, force, mode)
    out["speed_source"] = source.note
    out["baselines"] = speed.to_dict()
    if measure:
        row = speed.rows[0]
        out["measured"] = None if row.speedup is None else {
            "device": speed.device, "batch_size": speed.batch_size, "timing": speed.how,
            "speedup": round(row.speedup, 4), "p10": round(row.p10, 4),
            "p90": round(row.p90, 4), "rounds": speed.rounds}
    return out


def _beside_baselines(spec: Any, net: Any, pol: Any, batches: Any, ref: Any, value: float,
                      budget: Any, cost: Any, graph: Any, batch: Any, device: str, source: Any,
                      measure: bool, force: bool = False, mode: str = "eager") -> Any:
    """The policy next to fp32, one global bf16 / fp16 autocast and uniform tf32 (where the
    target has it): error on the eval data, estimated speed-up, measured where local (in
    the deployment ``mode``: compiled, one model copy per plan, for "compile")."""
    from autoprec.apply.apply import apply_policy
    from autoprec.evaluate import score
    from autoprec.metrics import batch_size_of
    from autoprec.policy import Policy
    from autoprec.search.confirm_speed import Row, baseline_rows, check_speed, measure_rows
    from autoprec.trace.graph import fingerprint

    def ok(err: float) -> bool:
        return budget is not None and err <= float(budget)

    rows = [Row("policy", "tuned", pol, value, ok(value) or budget is None,
                cost.speedup(pol), weight_bytes=cost.weight_bytes(pol))]
    # the baselines are built here, for this model: its fingerprint, so that applying them
    # warns of nothing (a fingerprint-less one warned "model.fingerprint: missing … (normal
    # for a hand-written policy)" about a file the user never wrote)
    model_id = {"fingerprint": fingerprint(net)}

    def eval_error(base: Policy) -> tuple[float, None]:
        with apply_policy(net, base, target=device):
            return score(spec, net, batches, ref, "of eval_data").value, None

    rows += baseline_rows(cost, eval_error, None if budget is None else float(budget),
                          lambda p, form: Policy(default=p, form=form, model=model_id))
    if not (measure and source.local):
        check = check_speed(rows, None)
        check.winner = None  # eval writes nothing: no row is marked
        check.reason = source.note if not source.local else "not measured (no --measure)"
        return check
    at_batch = source.cost_model(graph, batch_size_of(batch) or 1, mode)
    check = measure_rows(rows, spec.forward, net, batch, source.device, device, at_batch,
                         force=force, compile=mode == "compile")
    check.mark = "fastest within budget"
    return check


def _print_summary(s: dict[str, Any]) -> None:
    from autoprec.cost.model import PARTS
    from autoprec.report_json import batch_size_words
    from autoprec.search.confirm_speed import format_rows

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
    typer.echo("est. forward: " + ", ".join(
        f"{k} {b[k + '_us'] / total:.0%}" for k in PARTS)
        + f" of {total:.1f} us; {b['casts']} casts + {b['weight_casts']} weight casts per "
          f"forward, {b['kernels']} kernels")
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
