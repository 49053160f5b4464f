"""The names ``autoprec`` exports: each resolves to one thing, whatever was imported first.

``autoprec.trace`` and ``autoprec.probe`` are the stages' packages and
``autoprec.device.capability`` a module (importing ``autoprec.trace.graph`` binds the package
there); the functions they hold are exported as ``trace_model`` and ``probe_model``. The
list is the few names a user needs (issue 48), each one thing: ``autoprec.check`` is the
gate's function (its module is ``autoprec.evaluation.check``), never a module."""

from __future__ import annotations

import inspect

import autoprec
import autoprec.device.capability  # noqa: F401  (binds the module to autoprec.device.capability)
import autoprec.probe.table  # noqa: F401  (binds the package to autoprec.probe)
import autoprec.trace.graph  # noqa: F401  (binds the package to autoprec.trace)


def test_every_exported_name_is_one_of_autoprecs_classes_or_functions() -> None:
    for name in set(autoprec.__all__) - {"__version__"}:
        value = getattr(autoprec, name)
        assert inspect.isclass(value) or inspect.isfunction(value), (name, value)
        assert value.__module__.startswith("autoprec."), (name, value.__module__)


def test_the_stage_entry_points_do_not_collide_with_their_packages() -> None:
    assert inspect.ismodule(autoprec.trace) and inspect.ismodule(autoprec.probe)
    assert autoprec.trace_model is autoprec.trace.trace
    assert autoprec.probe_model is autoprec.probe.probe
    assert inspect.ismodule(autoprec.device.capability)
    assert not {"trace", "probe", "capability"} & set(autoprec.__all__)


def test_the_public_names_are_the_few_a_user_needs() -> None:
    import autoprec.evaluation.check  # noqa: F401  (the gate's module: it must not shadow the function)

    assert set(autoprec.__all__) == {
        "__version__", "tune", "TuneConfig", "TuneResult", "Target", "check", "CheckResult",
        "evaluate", "Evaluation", "Policy", "load_policy", "apply_policy", "ApplyOptions",
        "PolicyHandle", "trace_model", "LayerGraph", "probe_model", "SensitivityTable",
        "AutoprecError"}
    assert inspect.isfunction(autoprec.check) and inspect.isfunction(autoprec.evaluate)
    assert autoprec.check.__module__ == "autoprec.api"
    params = inspect.signature(autoprec.apply_policy).parameters
    assert len(params) == 8 and all(  # the rarely needed settings are in ApplyOptions
        p.kind is p.KEYWORD_ONLY for n, p in params.items() if n not in ("model", "policy"))
