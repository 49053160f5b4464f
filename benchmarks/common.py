"""What the benchmarks share: where the examples and the results are, and loading one.

Every benchmark loads its models through ``example`` / ``load_example`` (the examples'
model.py files under ``examples/``, the same the README's commands tune) and writes its
tables under ``RESULTS``. An unknown model name stops the script in one line naming the
known ones (exit 2), before any work.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from autoprec.workload.loading import ModelSpec, load_model_file

ROOT = Path(__file__).resolve().parent.parent  # the repository root
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ROOT / "policies"


def _refuse(why: str) -> None:
    """One line on stderr naming the script, exit 2 (bad input, as the CLI's)."""
    print(f"{Path(sys.argv[0]).stem}: {why}", file=sys.stderr)
    raise SystemExit(2)


def example_names() -> list[str]:
    """Every example with a model.py (``examples/<name>/model.py``)."""
    return sorted(p.parent.name for p in EXAMPLES.glob("*/model.py"))


def example(name: str) -> Path:
    """``examples/<name>/model.py``; an unknown name exits 2 in one line."""
    path = EXAMPLES / name / "model.py"
    if not path.is_file():
        _refuse(f"unknown model {name!r}; known: {', '.join(example_names())}")
    return path


def load_example(name: str) -> ModelSpec:
    """The ModelSpec of ``examples/<name>/model.py`` (``autoprec.workload.loading``)."""
    return load_model_file(example(name))


def choose(given: str | Iterable[str], known: Iterable[str], what: str = "model") -> list[str]:
    """The names of a ``--models a,b`` option, each checked against ``known`` (exit 2 in
    one line on an unknown one)."""
    names = [n.strip() for n in given.split(",")] if isinstance(given, str) else list(given)
    known = list(known)
    bad = [n for n in names if n not in known]
    if bad:
        _refuse(f"unknown {what} {bad[0]!r}; known: {', '.join(known)}")
    return [n for n in names if n]


__all__ = ["EXAMPLES", "POLICIES", "RESULTS", "ROOT", "choose", "example", "example_names",
           "load_example"]
