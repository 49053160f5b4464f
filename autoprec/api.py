"""The Python API for the model a user holds: ``tune``, ``check``, ``evaluate``.

Each takes the model as an ``nn.Module`` with its data as keywords — ``calibration`` (an
iterable of batches: a list, a generator, a ``torch.utils.data.DataLoader``), ``eval``
(held-out batches; default: the calibration batches), ``forward(model, batch)``,
``metric(outputs, batch)``, ``loss(outputs, batch)`` and ``name`` (default: the model's class
name) — exactly what a model.py provides; or the path of a model.py, as the CLI does
(``autoprec.workload.inputs.spec_of`` makes one ``ModelSpec`` of either). The model as given is the
reference; it is run in eval mode and handed back as it came (``inputs.kept_as_given``:
its train/eval flags and ``requires_grad``; the stages put back every weight, hook and
forward they touch). This module orchestrates; the work is in ``autoprec.tuning.tune``,
``autoprec.evaluation.check`` and ``autoprec.evaluation.eval_report``. Their messages name
the keyword arguments given here (``max_error``, ``force=True``), not the CLI's flags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.errors import InputError
from autoprec.evaluation.json_fields import Reason
from autoprec.io.validate import as_keywords, keyword_errors
from autoprec.workload.inputs import ModelLike, kept_as_given, spec_of

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from autoprec.evaluation.check import CheckResult
    from autoprec.evaluation.eval_report import Evaluation
    from autoprec.policy import Policy
    from autoprec.track import Tracker
    from autoprec.tuning.config import TuneConfig
    from autoprec.tuning.result import TuneResult

Batch = Any
Forward = Callable[["torch.nn.Module", Batch], Any]
Metric = Callable[[Any, Batch], float]
Loss = Callable[[Any, Batch], "torch.Tensor"]


def _needs_metric(caller: str, spec: Any, max_drop: Any) -> None:
    if max_drop is not None and spec.path is None and spec.metric is None:
        raise InputError(f"{caller}: max_drop is a drop of the metric: give "
                         "metric=fn(outputs, batch) -> float (higher is better)")


def tune(model: ModelLike, config: TuneConfig | None = None, *,
         calibration: Iterable[Batch] | None = None,
         eval: Iterable[Batch] | None = None,  # noqa: A002  (model.py's eval_data)
         forward: Forward | None = None, metric: Metric | None = None,
         loss: Loss | None = None, name: str | None = None,
         tracker: Tracker | None = None, profile: Any = None, **options: Any) -> TuneResult:
    """Find the fastest plan of ``model`` within the budget and write it as a policy.

    ``model``: an ``nn.Module`` with ``calibration=`` (and optionally ``eval``, ``forward``,
    ``metric``, ``loss``, ``name``; see the module docs), or a model.py path.
    ``config``: a ``TuneConfig``, or its fields as keywords (``max_error=0.01``,
    ``target="h100"``, ``batch_size``, ``trials``, ``out``, ``form``, …; every option of
    ``autoprec tune``). The policy is written to ``out`` (default
    ``policies/<name>-<target>.yaml``); the study and the probe cache sit beside it (the
    probe cache is keyed by the weights' and the batches' values, the functions' source and
    the versions, so a model in hand reuses it only while all of them are unchanged).
    ``tracker``: None logs nothing (``autoprec.track.make_tracker`` makes the CLI's MLflow
    one). ``profile``: a DeviceProfile to price with instead of the target's. Returns the
    ``TuneResult`` (``policy``, ``path``, ``error``, ``est_speedup``, ``feasible``; the rest
    by concern: ``plan``, ``search``, ``costs``, ``train_check``, ``report``).
    """
    from autoprec.tuning.tune import tune as run_tune

    def option(key: str) -> Any:
        return config.option(key) if config is not None else options.get(key)

    # a checkpoint folder tuned for training is held in fp32 (the trainer's masters)
    spec = spec_of(model, calibration=calibration, eval=eval, forward=forward, metric=metric,
                   loss=loss, name=name, caller="tune",
                   masters=bool(option("train_aware")) or option("form") == "train")
    _needs_metric("tune", spec, option("max_drop"))
    if option("train_aware") and spec.path is None and spec.loss is None:
        raise InputError("tune: train_aware checks training: give loss=fn(outputs, batch) "
                         "-> scalar tensor")
    with kept_as_given(model):
        return run_tune(spec, config, tracker=tracker, profile=profile, **options)


def check(model: ModelLike, policy: Policy | str | Path, *,
          calibration: Iterable[Batch] | None = None,
          eval: Iterable[Batch] | None = None,  # noqa: A002
          forward: Forward | None = None, metric: Metric | None = None,
          name: str | None = None, max_error: float | None = None,
          max_drop: float | None = None, target: str | None = None,
          batch_size: int | None = None, force: bool = False, compile: bool | None = None,
          fp8_backend: str | None = None, min_headroom: float | None = None) -> CheckResult:
    """The pre-deployment gate of ``autoprec check``: does ``policy`` (a Policy or a file)
    still hold for ``model``? Scored on the eval data against the policy's budget (or
    ``max_error`` / ``max_drop``), audited on a real forward, priced on ``target`` (default:
    the policy's). Returns the ``CheckResult`` (``passed``, ``reasons``, ``error``,
    ``est_speedup``, ``layers``, …) rather than raising; ``raise_if_failed()`` raises
    ``CheckFailed``. Arguments as ``evaluation.check.check``'s; the model as ``tune``'s."""
    from autoprec.evaluation.check import check as gate

    spec = spec_of(model, calibration=calibration, eval=eval, forward=forward, metric=metric,
                   name=name, caller="check", masters=_trains(model, policy))
    _needs_metric("check", spec, max_drop)
    with kept_as_given(model), keyword_errors():
        result = gate(spec, policy, max_error=max_error, max_drop=max_drop, force=force,
                      target=target, batch_size=batch_size, fp8_backend=fp8_backend,
                      compile=compile, min_headroom=min_headroom)
    # its reasons and notes name the CLI's flags; a Python caller reads its own arguments
    result.reasons = [Reason(as_keywords(r), getattr(r, "layer", None)) for r in result.reasons]
    result.notes = [as_keywords(n) for n in result.notes]
    return result


def evaluate(model: ModelLike, policy: Policy | str | Path, *,
             calibration: Iterable[Batch] | None = None,
             eval: Iterable[Batch] | None = None,  # noqa: A002
             forward: Forward | None = None, metric: Metric | None = None,
             name: str | None = None, target: str | None = None,
             batch_size: int | None = None, force: bool = False, measure: bool = False,
             compile: bool | None = None) -> Evaluation:
    """What ``autoprec eval`` reports: ``policy`` applied to ``model``, its error on the eval
    data, the audit of a real forward, its estimated speed-up on ``target`` beside fp32 and
    the one-liners (timed here with ``measure`` when the target is this machine). Returns an
    ``Evaluation`` (``error``, ``est_speedup``, ``feasible``, ``layers``; ``to_dict()`` is
    ``eval --json``'s object). The model as ``tune``'s."""
    from autoprec.evaluation.eval_report import Evaluation, eval_report

    spec = spec_of(model, calibration=calibration, eval=eval, forward=forward, metric=metric,
                   name=name, caller="evaluate", masters=_trains(model, policy))
    with kept_as_given(model), keyword_errors():
        report = eval_report(spec, policy, target=target, batch_size=batch_size, force=force,
                             measure=measure, compile=compile)
    return Evaluation.from_report(report)


def _trains(model: Any, policy: Policy | str | Path) -> bool:
    """A path given as the model under a training plan (a checkpoint folder is then held in
    fp32, the trainer's masters)."""
    if not isinstance(model, (str, Path)):
        return False
    from autoprec.policy.schema import Policy as PolicyType
    from autoprec.policy.schema import load_policy

    given = policy if isinstance(policy, PolicyType) else load_policy(policy)
    return given.form == "train"


__all__ = ["check", "evaluate", "tune"]
