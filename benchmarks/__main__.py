"""``python -m benchmarks list`` prints the suite by group; ``python -m benchmarks run NAME
[--toy] [ARGS…]`` runs one script (``--toy``: at the size the smoke test runs it)."""

from __future__ import annotations

import runpy
import sys
import tempfile

from benchmarks.registry import BENCHMARKS, GROUPS


def _list() -> None:
    for group, what in GROUPS.items():
        print(f"{group}: {what}")
        for name, b in BENCHMARKS.items():
            if b.group == group:
                print(f"  {name:<20} {b.question}")


def _run(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        given = argv[0] if argv else ""
        print(f"benchmarks: unknown benchmark {given!r}; known: {', '.join(sorted(BENCHMARKS))}",
              file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if "--toy" in rest:
        toy = BENCHMARKS[name].toy
        if toy is None:
            print(f"benchmarks: {name} has no toy size ({BENCHMARKS[name].untested_because})",
                  file=sys.stderr)
            return 2
        rest = [a for a in rest if a != "--toy"]
        tmp = tempfile.mkdtemp(prefix=f"{name}-")
        rest = [a.replace("{tmp}", tmp) for a in toy] + rest
    sys.argv = [f"benchmarks.{name}", *rest]
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        _list()
        return 0
    if argv[:1] == ["run"]:
        return _run(argv[1:])
    print("usage: python -m benchmarks list | run NAME [--toy] [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
