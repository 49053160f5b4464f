"""The one Markdown table the benchmarks print (benchmarks/tables.py), and the depth and size
benchmarks' rows rendered through it: one cell per column."""

from __future__ import annotations

import importlib
import os

from benchmarks.tables import load_line, markdown


def test_a_table_is_a_header_a_rule_and_one_line_per_row() -> None:
    text = markdown(("a", "b c"), [("x", 1), (2.5, "")])
    assert text.splitlines() == ["| a | b c |", "|---|---|", "| x | 1 |", "| 2.5 |  |"]
    assert markdown(("only",), []) == "| only |\n|---|"


def test_the_load_line_states_both_averages_and_the_cpus() -> None:
    n = os.cpu_count()
    assert load_line(1.234, 5.0) == f"load average (1 min) 1.23 before, 5.00 after; {n} CPUs"
    assert load_line(0, 0, "AMD EPYC").endswith(f"; {n} CPUs (AMD EPYC)")


def _cells_per_line(text: str) -> set[int]:
    return {line.count("|") - 1 for line in text.splitlines()}


def test_the_depth_and_size_rows_fill_every_column() -> None:
    depth = importlib.import_module("benchmarks.tune_depth")
    row = {"model": "gpt2", "blocks": 4, "layers": 17, "total": 12.3, "trace": 1.2,
           "probe": 2.5, "cost": 0.4, "planner": 0.8, "evaluate": 5.5, "other": 1.9,
           "forwards": 40, "fwd_other": 3, "fwd_trace": 1, "fwd_probe": 20, "fwd_eval": 16,
           "evaluated": 8, "priced": 1234, "speedup": 2.345, "alt_tf32": 1.5,
           "alt_bf16": 2.0, "alt_fp16": 2.1, "error": 0.00987}
    text = depth._table([row])
    assert _cells_per_line(text) == {len(depth.COLUMNS)}
    assert text.splitlines()[2].startswith("| gpt2 | 4 | 17 | 12.3 | 1.2 | 2.5 |")
    assert "| 40 (3+1+20+16 in 8 runs) | 1234 | 2.35x | 1.50 / 2.00 / 2.10 | 0.0099 |" in text

    size = importlib.import_module("benchmarks.tune_size")
    row = {"model": "llama", "dtype": "bf16", "layers": 2, "weights": 4.4e8, "params": 2.2e8,
           "peak": 1.3e9, "peak_over_w": 2.95, "bound": 2.88e9, "within": False,
           "wall": 123.4, "error": 0.0123, "budget": 0.05, "est": 2.5, "est_ref": 1.4,
           "default": "bf16", "rules": 3, "fp8": 2, "stages": {"trace": 1.1e9}}
    text = size.table([row])
    assert _cells_per_line(text) == {len(size.COLUMNS)}
    assert text.splitlines()[2] == (
        "| llama (bf16) | 2 | 0.44 GB | 220 M | 1.30 GB | 2.95x | 2.88 GB | NO | 123 "
        "| 0.0123 (0.05) | 2.50x | 1.40x | default bf16, 3 rules (2 fp8) | trace 1.10 |")
