"""The suite's own layout: test modules are imported by their base name (no packages under tests/), so
two files of one name in different folders stop pytest at collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_test_files_share_a_name() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for p in TESTS.rglob("test_*.py"):
        seen[p.name].append(str(p.relative_to(TESTS)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}
