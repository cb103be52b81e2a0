"""Smoke test of benchmarks/bench_budget.py: the tiny state, 2 s windows, a budgeted flush next to training
and training alone; no timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.bench
def test_bench_budget_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_budget

    out = tmp_path / "out"
    argv = ["--quick", "--window", "2", "--modes", "budgeted,none", "--out", str(out), "--dir", str(tmp_path)]
    assert bench_budget.main(argv) == 0

    (jsonl,) = out.glob("budget-*.jsonl")
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert recs[0]["kind"] == "machine"
    modes = {r["mode"]: r for r in recs if r["kind"] == "mode"}
    assert set(modes) == {"budgeted", "none"}
    flush = modes["budgeted"]
    assert flush["saves"] >= 3 and flush["rate"] > 0 and len(flush["bins"]) == 2
    assert flush["bucket"]["charged_bytes"] > 0 and flush["bucket"]["unthrottled_bytes"] == 0
    assert all(s > 0 for s in modes["none"]["step_secs"]) and "rate" not in modes["none"]
    (md,) = out.glob("budget-*.md")
    assert "| budgeted |" in md.read_text() and "of the budget over 2 s" in md.read_text()
