"""Policy files: the reviewable per-layer precision map (schema 1) and its checks against a
model. Which rule covers a module is decided by the compiled plan (``autoprec.plan``:
``compile_plan``, ``resolve``, ``assignment``, ``resolve_path``)."""

from __future__ import annotations

from autoprec.policy.modules import (
    Resolved,
    check_model,
    gemm_leaf_paths,
    is_gemm_leaf,
)
from autoprec.policy.schema import (
    SCHEMA_VERSION,
    FingerprintMismatch,
    Policy,
    PolicyWarning,
    load_policy,
    loads_policy,
)

__all__ = [
    "SCHEMA_VERSION",
    "FingerprintMismatch",
    "Policy",
    "PolicyWarning",
    "Resolved",
    "check_model",
    "gemm_leaf_paths",
    "is_gemm_leaf",
    "load_policy",
    "loads_policy",
]
