"""``autoprec tune`` and ``autoprec export``: thin wrappers over autoprec.tuning.tune."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from autoprec.cli import target_names
from autoprec.device.targets import DEFAULT_TARGET
from autoprec.errors import CheckFailed
from autoprec.evaluation.json_fields import batch_size_from, batch_size_words

if TYPE_CHECKING:
    from autoprec.evaluation.speed_check import SpeedCheck
    from autoprec.tuning.result import RunCosts, TrainCheckRuns, TuneResult


def tune_cmd(
    model: Annotated[Path, typer.Argument(help="model.py (build_model, calibration_data, …)")],
    max_error: Annotated[float | None, typer.Option(help="Budget: relative L2 error of the outputs vs fp32 (default 0.01).")] = None,
    max_drop: Annotated[float | None, typer.Option(help="Budget: drop of model.py's metric vs fp32.")] = None,
    target: Annotated[str, typer.Option(help=f"Target device profile: {target_names()}.")] = DEFAULT_TARGET,
    batch_size: Annotated[int | None, typer.Option(help="Batch size the speed is priced at (default: the calibration batch's): the serving batch, or with --form train the training micro-batch (one forward + backward + optimizer step).")] = None,
    precisions: Annotated[str | None, typer.Option(help="Comma list, e.g. fp16,bf16,fp8 (default: all the target supports).")] = None,
    trials: Annotated[int, typer.Option(help="Trials this process runs.")] = 40,
    timeout: Annotated[float | None, typer.Option(help="Stop after this many seconds.")] = None,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 0,
    patience: Annotated[int | None, typer.Option(help="Stop after K trials without improvement.")] = None,
    min_speedup: Annotated[float | None, typer.Option(help="Speed target: estimated speed-up the policy must reach.")] = None,
    out: Annotated[Path | None, typer.Option(help="Policy file (default policies/<model>-<target>.yaml).")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage: sqlite:///PATH, postgresql://…, journal:PATH (default: SQLite beside the policy).")] = None,
    study_name: Annotated[str | None, typer.Option(help="Study to create or join.")] = None,
    resume: Annotated[bool, typer.Option(help="Run until the study holds --trials finished trials.")] = False,
    pareto: Annotated[bool, typer.Option(help="Keep the whole error/speed front; write one policy per point.")] = False,
    lock: Annotated[list[str] | None, typer.Option(help="Module path the search may not change (repeatable).")] = None,
    train_aware: Annotated[bool, typer.Option(help="Tune for training (implies --form train): gradient probes exclude layers whose gradients flush, and the written plan, like the one-liners (bf16=True / fp16=True autocast), must pass a short training run against fp32 (needs loss() in model.py; docs/training.md).")] = False,
    train_steps: Annotated[int, typer.Option(help="--train-aware: optimizer steps of the short run (from one init, on the calibration batches).")] = 16,
    train_lr: Annotated[float, typer.Option(help="--train-aware: AdamW learning rate of the short run.")] = 1e-4,
    max_loss_gap: Annotated[float, typer.Option(help="--train-aware: largest eval-loss gap to fp32 after the short run, relative (0.01 = 1 %).")] = 0.01,
    form: Annotated[str | None, typer.Option(help="How the plan runs: deploy (weights stored in each layer's precision, like model.to(bf16); the default) or train (autocast over fp32 masters, priced and timed as a whole training step: forward, backward, AdamW, GradScaler with fp16; the default with --train-aware).")] = None,
    max_weight_mb: Annotated[float | None, typer.Option(help="Weight-memory budget: a plan whose weights take more megabytes on the device is not a choice (the model must fit the card).")] = None,
    memory_limit: Annotated[float | None, typer.Option(help="Gigabytes the device offers (default: available host memory, or the GPU's): a model it cannot hold twice is refused up front; with --form train a plan whose training step (weights, grads, AdamW state, saved activations) needs more is not a choice.")] = None,
    compile_mode: Annotated[bool, typer.Option("--compile", help="Price plans as torch.compile (inductor) runs them: casts and pointwise ops fused between GEMMs; the policy records target.mode: compile.")] = False,
    fuse_groups: Annotated[str, typer.Option(help="auto: layers a fused runtime runs as one GEMM (q/k/v, gate/up, an MoE layer's experts; by names and by a shared input) take one precision, as vLLM needs to load the plan (autoprec save); off: every layer its own.")] = "off",
    workers: Annotated[int, typer.Option(help="Run N worker processes on one shared study.")] = 1,
    measure: Annotated[bool, typer.Option("--measure/--no-measure", help="When the target is this machine (cpu, or the GPU here): calibrate its profile here first and time the winner against fp32 and one global autocast, never writing a plan measured slower.")] = True,
    mlflow_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI (default: ./mlflow.db).")] = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment name.")] = "autoprec",
    no_track: Annotated[bool, typer.Option("--no-track", help="Do not log to MLflow.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    report: Annotated[Path | None, typer.Option(help="Also write the tables and plots (trials, per-layer precisions, tuned vs one global autocast) into this folder.")] = None,
) -> None:
    """Search per-layer precisions for MODEL and write the fastest policy within budget."""
    from autoprec.cli import current_argv
    from autoprec.errors import TuneInterrupted
    from autoprec.study.workers import WORKER_INDEX_ENV, run_workers, worker_seed
    from autoprec.track import make_tracker
    from autoprec.tuning.config import TuneConfig
    from autoprec.tuning.tune import tune

    # The one config of this tune, checked once before anything runs: workers, tracking,
    # model.py, probes. tune() and the writer read it as it is.
    cfg = TuneConfig(
        max_error=max_error, max_drop=max_drop, target=target, batch_size=batch_size,
        precisions=precisions, trials=trials, timeout=timeout, seed=seed, patience=patience,
        min_speedup=min_speedup, storage=storage, study_name=study_name, resume=resume,
        pareto=pareto, out=out, locked=tuple(lock or ()), train_aware=train_aware,
        train_steps=train_steps, train_lr=train_lr, max_loss_gap=max_loss_gap,
        progress=not quiet and not json_out, measure=measure, report=report,
        compile=compile_mode, form=form, max_weight_mb=max_weight_mb,
        memory_limit_gb=memory_limit, fuse_groups=fuse_groups,
    ).validated(workers=workers, model=model, mlflow_uri=None if no_track else mlflow_uri,
                cli=True)
    target = cfg.pricing.target  # --target CPU is cpu (the name of the policy file too)
    if workers > 1:
        if measure:  # calibrate a local target once: every worker prices on the same profile
            from autoprec.pricing.speed_source import calibration_dir
            from autoprec.pricing.target import resolve_target

            resolve_target(cfg.pricing.target, compile=cfg.pricing.compile, form=cfg.pricing.form, measure=True,
                           cache_dir=calibration_dir(cfg.output.out, cfg.output.cache_dir))
        code = run_workers(list(current_argv), workers)
        raise typer.Exit(code)
    # A worker started by --workers: its own seed (environment read at the CLI boundary).
    index_text = os.environ.get(WORKER_INDEX_ENV)
    worker_index = int(index_text) if index_text and index_text.isdigit() else None
    cfg = cfg.with_seed(worker_seed(cfg.search.seed, worker_index) or cfg.search.seed)
    # Tracking is checked first: an unreachable server is exit 2 before any expensive work.
    tracker = make_tracker(mlflow_uri, experiment, enabled=not no_track, workdir=Path.cwd())
    try:
        result = tune(model, cfg, tracker=tracker)
    except TuneInterrupted as err:  # main prints "interrupted" and exits 130
        print(f"autoprec: {err.cli_hint(current_argv)}", file=sys.stderr)
        raise
    for note in result.plan.notes:
        print(f"autoprec: note: {note}", file=sys.stderr)
    summary = _summary(result, target, compile_mode)
    summary["batch_size_from"] = batch_size_from(batch_size)
    if json_out:
        print(json.dumps(summary, indent=2))
    else:
        _print_result(summary, result, target, compile_mode)
        if result.report:
            print(f"report: {report}/ ({', '.join(p.name for p in result.report)})")
        _next_steps(model, result, target, tracker)
    if not result.feasible:
        raise _not_feasible(result, min_speedup, summary["error"])


def _summary(result: TuneResult, target: str, compile_mode: bool) -> dict[str, Any]:
    """The result as ``--json`` prints it (its keys name the former flat fields)."""
    plan, search, costs, train = result.plan, result.search, result.costs, result.train_check
    policy = plan.policy
    return {
        "policy": str(plan.path), "feasible": plan.feasible,
        "error": _num(plan.eval_error), "calibration_error": _num(plan.error),
        "budget": plan.budget, "est_speedup": round(plan.est_speedup, 4),
        "target": target, "mode": policy.mode,
        "batch_size": policy.target.get("batch_size")
        if isinstance(policy.target, dict) else None,
        "trials": search.trials, "evaluations": round(search.evaluations, 2),
        "seconds": round(costs.seconds, 1), "study": search.study_name,
        "storage": search.storage, "front": [str(p) for p in plan.front_paths],
        "mlflow_run": policy.provenance.get("mlflow_run"),
        "search_complete": search.complete, "candidates": search.method,
        "plans_priced": search.priced, "plans_measured": search.measured,
        "est_casts": policy.metrics.get("est_casts"), "notes": plan.notes,
        "form": policy.form, "weight_bytes": policy.metrics.get("weight_bytes"),
        "measured_speedup": policy.metrics.get("measured_speedup"),
        "baselines": plan.speed.to_dict() if plan.speed is not None else None,
        "report": [str(p) for p in result.report],
        # the model as given (what errors are measured against); fp32 for an fp32 model
        "reference": plan.reference.to_dict(),
        "est_speedup_over_reference": policy.metrics.get(
            "est_speedup_over_reference", round(plan.est_speedup, 4)),
        "model_weight_bytes": plan.weight_bytes,
        "peak_memory_bytes": costs.peak_memory, "peak_memory_measured": costs.peak_memory_how,
        # each stage's own peak (autoprec.tuning.memory.StagePeaks), and the stage that set the peak
        "memory_stages": dict(costs.memory_stages),
        "peak_memory_stage": (max(costs.memory_stages, key=costs.memory_stages.__getitem__)
                              if costs.memory_stages else None),
        "stage_seconds": dict(costs.stage_seconds),
        "stage_cpu_seconds": dict(costs.stage_cpu_seconds),
        "train_check_seconds": round(train.seconds, 2),
        "train_checks": list(train.verdicts),
    }


def _print_result(summary: dict[str, Any], result: TuneResult, target: str,
                  compile_mode: bool) -> None:
    """The policy's rules, its error and speed, and the rows beside it, for people."""
    plan, search, costs = result.plan, result.search, result.costs
    lowered = plan.policy.layers
    print(f"policy: {plan.path}  ({len(lowered)} layer rules, default {plan.policy.default}, "
          f"form {plan.policy.form})")
    for k, v in lowered.items():
        print(f"  {k:<50} {v}")
    measured = summary["measured_speedup"]
    over = ("" if plan.reference.is_fp32 else
            f" over fp32 ({summary['est_speedup_over_reference']:.2f}x over the "
            f"{plan.reference.label()} model as given)")
    print(f"error {_sig(plan.eval_error)} (budget {plan.budget:g}"
          + ("" if plan.reference.is_fp32 else
             f", against the {plan.reference.label()} model's own outputs")
          + f"), est. speed-up {plan.est_speedup:.2f}x{over} on {target}{' compiled' if compile_mode else ''} at "
          f"{batch_size_words(summary['batch_size'], summary['batch_size_from'])}"
          + (f", measured {measured:.2f}x here" if measured is not None else "")
          + f", {summary['est_casts']} casts per forward, weights "
          f"{(summary['weight_bytes'] or 0) / 1e6:.1f} MB, {search.trials} trials, "
          f"{search.evaluations:.1f} evaluations, "
          f"{costs.seconds:.0f}s" + (f"; search complete ({search.priced} plans priced, "
                                     f"{search.measured} measured)"
                                     if search.complete else ""))
    if costs.peak_memory:
        w = plan.weight_bytes
        ratio = f", {costs.peak_memory / w:.2f}x the model's {w / 1e9:.2f} GB of weights" \
            if w else ""
        print(f"peak memory {costs.peak_memory / 1e9:.2f} GB "
              f"({costs.peak_memory_how}){ratio}")
        if costs.memory_stages:
            print("  per stage: " + ", ".join(f"{k} {v / 1e9:.2f} GB"
                                              for k, v in costs.memory_stages.items()))
    if costs.stage_seconds:
        print(stage_time_line(costs, result.train_check))
    if result.train_check.table:
        print("\n".join(result.train_check.table))
    if plan.speed is not None:
        _print_speed(plan.speed)


def _not_feasible(result: TuneResult, min_speedup: float | None, error: Any) -> CheckFailed:
    """Exit 1 when the written policy is the closest, not a feasible one: which target
    it missed."""
    plan = result.plan
    if (min_speedup is not None and plan.eval_error <= plan.budget
            and plan.est_speedup < min_speedup):
        return CheckFailed(
            f"no policy reaches the speed target --min-speedup {min_speedup:g} within "
            f"budget {plan.budget}: the closest is est. {plan.est_speedup:.2f}x "
            f"(error {error}, within budget); wrote it to {plan.path} "
            "marked feasible: false")
    return CheckFailed(f"no feasible policy within budget {plan.budget}; wrote the "
                       f"closest (error {_sig(plan.eval_error)}) to {plan.path} marked "
                       "feasible: false")


def stage_time_line(costs: RunCosts, train_check: TrainCheckRuns) -> str:
    """``time per stage (wall / CPU)``: each stage's wall and CPU seconds (``costs``), and
    the confirm stage's short training runs (``train_check``); the CPU time is what the
    tune itself spent (the wall time also counts other processes' turns on a shared
    machine)."""
    cpu = costs.stage_cpu_seconds

    def both(wall: float, c: float | None) -> str:
        return f"{wall:.1f} s" if c is None else f"{wall:.1f} / {c:.1f} s"

    train = (f" (of which short training runs "
             f"{both(train_check.seconds, train_check.cpu_seconds if cpu else None)})"
             if train_check.verdicts else "")
    return ("time per stage (wall / CPU): " if cpu else "time per stage: ") + ", ".join(
        f"{k} {both(v, cpu.get(k))}" for k, v in costs.stage_seconds.items()) + train


def _print_speed(speed: SpeedCheck) -> None:
    """The written plan beside its baselines, and why it was written (the decision's
    reasons in words: ``evaluation.explain.render``)."""
    from autoprec.evaluation.explain import render

    print("")
    print(speed.table())
    where = (f"measured on {speed.device} at batch size {speed.batch_size} ({speed.how}, "
             f"{speed.rounds} interleaved rounds)" if speed.measured else "estimated")
    print(f"speed: {where}; {render(speed.decision)}")
    print(f"pick: {speed.recommendation()}")


def _next_steps(model: Path, result: object, target: str, tracker: object) -> None:
    """What to do with the policy: check it, see where the time goes, apply it; where the
    MLflow run is."""
    from autoprec.cli.runnable import autoprec_command, tool_command

    path = result.path  # type: ignore[attr-defined]
    cmd = autoprec_command()  # as it runs from here: .venv/bin/autoprec when not activated
    print(f"next: {cmd} check {model} --policy {path}      # the CI gate, on eval data")
    print(f"      {cmd} eval {model} --policy {path} --target {target}   # where the "
          "time goes")
    print(f'      python: autoprec.apply_policy(model, "{path}")')
    run_id = result.policy.provenance.get("mlflow_run")  # type: ignore[attr-defined]
    if run_id:
        where = getattr(tracker, "run_url", None) or (
            f"{tool_command('mlflow')} ui --backend-store-uri "
            f"{getattr(tracker, 'shown_uri', '')}")
        print(f"      MLflow run {run_id}: {where}")


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def _sig(x: float) -> str:
    """4 significant digits for people (the policy file and --json keep more)."""
    return f"{x:.4g}" if math.isfinite(x) else "inf"




def export_cmd(
    storage: Annotated[str, typer.Option(help="Optuna storage URL of the study.")],
    study_name: Annotated[str, typer.Option(help="Study to read.")],
    out: Annotated[Path, typer.Option(help="Policy file to write.")],
) -> None:
    """Write the policy of a (shared) study: its fastest trial within budget."""
    from autoprec.study.export import export_policy

    policy, feasible = export_policy(storage, study_name, out)
    print(f"policy: {out}  ({len(policy.layers)} layer rules, est. speed-up "
          f"{policy.metrics.get('est_speedup')}x, feasible: {feasible})")
    if not feasible:
        raise CheckFailed(f"no trial of study {study_name!r} is within budget; wrote the closest")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_cmd)
    app.command("export")(export_cmd)
