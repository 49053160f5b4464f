"""The names ``autoprec`` exports: each resolves to one thing, whatever was imported first.

``autoprec.trace`` and ``autoprec.probe`` are the stages' packages and
``autoprec.capability`` a module (importing ``autoprec.trace.graph`` binds the package
there); the functions they hold are exported as ``trace_model``, ``probe_model`` and
``can_run``."""

from __future__ import annotations

import inspect

import autoprec
import autoprec.capability  # noqa: F401  (binds the module to autoprec.capability)
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
    assert inspect.ismodule(autoprec.capability)
    assert autoprec.can_run is autoprec.capability.capability
    assert autoprec.can_run("fp32") == (True, "fp32: always available")
    assert not {"trace", "probe", "capability"} & set(autoprec.__all__)
