"""The rows a plan is shown beside, as a table: a row the cost model cannot price (the
train form's ``model.to(bf16)``: no fp32 masters to step) shows no speed-up, and why."""

from __future__ import annotations

import math

from autoprec.evaluation.rows import Row, format_rows, label
from autoprec.policy import Policy

WHY = "--form train: it stores no fp32 masters"


def _check(rows: list[Row]) -> dict:
    return {"rows": [r.to_dict() for r in rows], "measured_on": None, "chosen": "tuned",
            "mark": "written"}


def test_an_unpriceable_row_shows_a_dash_and_its_reason_not_zero() -> None:
    fp32 = Row(label("fp32"), "baseline", Policy(default="fp32", form="train"), 0.0, True, 1.0)
    stored = Row(label("bf16", "deploy"), "baseline", Policy(default="bf16", form="deploy"),
                 0.004, False, 1.0 / math.inf, why_not=WHY)
    tuned = Row("tuned", "tuned", Policy(default="bf16", form="train"), 0.003, True, 2.61)
    check = _check([tuned, fp32, stored])
    assert check["rows"][2]["est_speedup"] is None and check["rows"][2]["why_not"] == WHY
    assert check["rows"][0]["est_speedup"] == 2.61
    lines = format_rows(check).splitlines()
    row = next(ln for ln in lines if ln.startswith("bf16 (model.to(bfloat16))"))
    assert "0.00x" not in row and WHY in row
    assert row.split()[3] == "-"  # the est. speed-up cell (after the name's 3 words)
    assert "2.61x" in next(ln for ln in lines if ln.startswith("tuned"))
