"""Mutation table of the apply tests: each case with one rule (or one backend) run in the
wrong precision, checked by the comparison the tests use now (fp32's tolerance against a
reference that rounds every layer at its own precision) and by the one they used before
(``dtype_tols`` of the lowest precision in the policy).

    python experiments/apply_mutations.py            # markdown table on stdout
    python experiments/apply_mutations.py --summary  # counts per wrong precision only

The cases and mutations are those of tests/apply/test_wrong_precision_is_caught.py, which
asserts the "now" column; the "before" column shows what that test replaced.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprec.precisions import dtype_tols, rank  # noqa: E402
from tests.apply import refs  # noqa: E402
from tests.apply import test_apply_boundaries as boundaries  # noqa: E402
from tests.apply import test_apply_mixed as mixed  # noqa: E402
from tests.apply import test_wrong_precision_is_caught as mut  # noqa: E402


def _fails(run: Callable[[], object]) -> bool:
    try:
        run()
    except AssertionError:
        return True
    return False


def _both(run: Callable[[], object], lowest: str) -> tuple[bool, bool]:
    """(fails before, fails now) for one mutant."""
    now = _fails(run)
    saved = refs.SAME
    refs.SAME = dtype_tols(lowest)
    try:
        before = _fails(run)
    finally:
        refs.SAME = saved
    return before, now


def rows() -> list[tuple[str, str, str, bool, bool]]:
    out = []
    for test, make, target, rule, wrong in mut.policy_mutations():
        m, p, hand = make()
        lowest = max(p.precisions, key=rank)
        prec = p.default if rule == mut.DEFAULT else p.layers[rule.split("/")[0]]
        applied = mut._mutated(p, rule, wrong)
        b, n = _both(lambda m=m, p=p, hand=hand, a=applied, t=target:
                     boundaries.check(m, p, hand, applied=a, target=t), lowest)
        out.append((test, f"{rule} ({prec})", wrong, b, n))
    for fault, (prec, wrong, breaks) in mut.BACKEND_FAULTS.items():
        for case in boundaries.NET_CASES:
            mp = pytest.MonkeyPatch()
            try:
                breaks(mp)
                m, p, hand = boundaries.net_case(prec, case)
                lowest = max(p.precisions, key=rank)
                b, n = _both(lambda m=m, p=p, hand=hand: boundaries.check(m, p, hand), lowest)
            finally:
                mp.undo()
            out.append((f"test_net_boundaries[{case}-{prec}]", f"backend: {fault}", wrong, b, n))
    for rule, wrong in mut.MIXED_MUTATIONS:
        b, n = _both(lambda r=rule, w=wrong: mixed.check_mixed({**mixed.MIXED, r: w}), "fp8")
        out.append(("test_mixed_policy_matches_hand_casts", f"{rule} ({mixed.MIXED[rule]})",
                    wrong, b, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", action="store_true", help="counts only")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    table = rows()
    yn = {True: "yes", False: "**no**"}
    if not args.summary:
        print("| test | layer (its precision) | injected | fails before | fails now |")
        print("|---|---|---|---|---|")
        for test, layer, wrong, b, n in table:
            print(f"| {test} | {layer} | {wrong} | {yn[b]} | {yn[n]} |")
        print()
    by = Counter((layer.split(" (")[-1].rstrip(")") if not layer.startswith("backend")
                  else layer, wrong, b, n) for _, layer, wrong, b, n in table)
    print("| rule's precision -> injected | mutants | caught before | caught now |")
    print("|---|---|---|---|")
    keys = sorted({k[:2] for k in by})
    for prec, wrong in keys:
        total = sum(c for k, c in by.items() if k[:2] == (prec, wrong))
        before = sum(c for k, c in by.items() if k[:2] == (prec, wrong) and k[2])
        now = sum(c for k, c in by.items() if k[:2] == (prec, wrong) and k[3])
        print(f"| {prec} -> {wrong} | {total} | {before} | {now} |")
    print(f"\n{len(table)} mutants: {sum(r[3] for r in table)} caught before, "
          f"{sum(r[4] for r in table)} caught now")


if __name__ == "__main__":
    main()
