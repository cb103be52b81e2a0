"""Smoke test of benchmarks/bench_restart.py: the tiny size, one repeat, restores and a restart in new
processes next to the busy neighbour (four processes in all); no timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.bench
def test_bench_restart_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_restart

    out = tmp_path / "out"
    argv = [
        "--quick",
        "--repeats",
        "1",
        "--no-fio",
        "--conditions",
        "busy",
        "--ops",
        "raw,tierckpt",
        "--restarts",
        "tierckpt",
        "--settle",
        "0",
    ]
    assert bench_restart.main([*argv, "--profile", "--out", str(out), "--dir", str(tmp_path)]) == 0

    (jsonl,) = out.glob("restart-*.jsonl")
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert recs[0]["kind"] == "machine" and recs[-1]["kind"] == "end"
    samples = [r for r in recs if r["kind"] == "sample"]
    assert sorted((r["cond"], r["op"]) for r in samples) == [("busy", "raw"), ("busy", "tierckpt")]
    for r in samples:  # every restore ran in its own process and was measured inside and outside it
        assert r["secs"] > 0 and r["cpu"] >= 0 and r["proc_cpu"] >= r["cpu"] and r["minflt"] >= 0
    e2e = [r for r in recs if r["kind"] == "e2e"]
    assert [(r["cond"], r["how"]) for r in e2e] == [("busy", "tierckpt")]
    for r in e2e:  # the restarted job's first step computes what the uninterrupted job computed
        assert r["loss_ok"] and r["t_spawn"] <= r["marks"]["built"] <= r["marks"]["restored"] <= r["marks"]["stepped"]
    prof = [r for r in recs if r["kind"] == "profile"]
    assert prof and {"wait", "verify+carve", "populate"} <= set(prof[0]["profile"])

    md = (out / Path(recs[-1]["md"]).name).read_text()
    assert "tierckpt `restore()` (fresh tensors)" in md and "End-to-end restart" in md and "% of raw" in md
    assert not any(p.name.startswith("bench-restart-") for p in tmp_path.iterdir())  # scratch removed
