"""The tables the benchmarks print and the lines that say where their figures came from.

``markdown(columns, rows)`` is the one Markdown table every benchmark prints (a header, the
``---`` row, one line per row of already formatted cells); ``cpu_name()`` is ``lscpu``'s
model name (the CPU a wall time was measured on); ``load_line`` states the 1-minute load
average before and after a run and the CPUs it ran on, as timings under load must.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable, Sequence


def markdown(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: ``columns`` as the header, each row's cells as given (``str()``)."""
    for_row = [f"| {' | '.join(str(c) for c in row)} |" for row in rows]
    return "\n".join([f"| {' | '.join(columns)} |", "|" + "---|" * len(columns), *for_row])


def cpu_name() -> str:
    """``lscpu``'s model name (what the wall times were measured on), or the platform's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Model name:")), "unknown CPU")


def load_average() -> float:
    """The 1-minute load average now (read before and after a timed run)."""
    return os.getloadavg()[0]


def load_line(before: float, after: float, cpu: str | None = None) -> str:
    """``load average (1 min) B before, A after; N CPUs`` (and ``(cpu)`` when given)."""
    cpus = f"{os.cpu_count()} CPUs" + (f" ({cpu})" if cpu else "")
    return f"load average (1 min) {before:.2f} before, {after:.2f} after; {cpus}"
