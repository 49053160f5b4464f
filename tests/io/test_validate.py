"""The CLI's flags in a message, written as the Python keyword arguments they stand for."""

from __future__ import annotations

import pytest

from autoprec.errors import FingerprintMismatch, InputError
from autoprec.io.validate import as_keywords, keyword_errors


@pytest.mark.parametrize(("cli", "python"), [
    ("--max-error: must be a finite number > 0, got -1",
     "max_error: must be a finite number > 0, got -1"),
    ("--form must be one of deploy, train, got 'x'", "form must be one of deploy, train, got 'x'"),
    ("p.yaml: … another structure; re-tune it, or force it (--force)",
     "p.yaml: … another structure; re-tune it, or force it (force=True)"),
    ("--lock 'fc9': model.py has no such module", "locked 'fc9': model.py has no such module"),
    ("--memory-limit must be a positive number", "memory_limit_gb must be a positive number"),
    ("tune --json prints one object", "tune --json prints one object"),
])
def test_flags_become_keywords(cli: str, python: str) -> None:
    assert as_keywords(cli) == python


def test_keyword_errors_keeps_the_error_class() -> None:
    with pytest.raises(FingerprintMismatch, match=r"\(force=True\)$"), keyword_errors():
        raise FingerprintMismatch("p.yaml: does not match; force it (--force)")
    with pytest.raises(InputError, match="^--trials"), keyword_errors(enabled=False):
        raise InputError("--trials: must be >= 1")
