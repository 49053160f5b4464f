"""Policy files: the reviewable per-layer precision map (schema 1) and its resolution."""

from __future__ import annotations

from autoprec.policy.resolve import (
    Resolved,
    assignment,
    check_model,
    gemm_leaf_paths,
    is_gemm_leaf,
    resolve,
    resolve_path,
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
    "assignment",
    "check_model",
    "gemm_leaf_paths",
    "is_gemm_leaf",
    "load_policy",
    "loads_policy",
    "resolve",
    "resolve_path",
]
