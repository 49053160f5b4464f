"""The plan stage: a policy and a model compiled into regions, precisions and wrappers
(``compile``), the one place that decides which rule covers a module; and the replay of a
recorded forward under a plan (``schedule``)."""

from __future__ import annotations

from autoprec.plan.compile import (
    ExecutionPlan,
    assignment,
    compile_plan,
    resolve,
    resolve_path,
)

__all__ = ["ExecutionPlan", "assignment", "compile_plan", "resolve", "resolve_path"]
