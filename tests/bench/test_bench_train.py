"""Smoke test of benchmarks/bench_train.py: a tiny model, every mode, one repeat; no timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.bench
def test_bench_train_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_train

    out = tmp_path / "out"
    argv = ["--quick", "--steps", "2", "--warmup", "1", "--repeats", "1", "--probe-saves", "1"]
    rc = bench_train.main([*argv, "--out", str(out), "--dir", str(tmp_path)])
    assert rc == 0

    (jsonl,) = out.glob("train-*.jsonl")
    (md,) = out.glob("train-*.md")
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "machine" and kinds[-1] == "end"
    assert recs[-1]["check_failed"] is False

    skipped = {r["mode"] for r in recs if r["kind"] == "skip"}
    assert not skipped & {"none", "tierckpt-lazy", "tierckpt-sync"}
    ran = [m for m in bench_train.MODES if m not in skipped]
    samples = [r for r in recs if r["kind"] == "sample"]
    summary = {r["mode"]: r for r in recs if r["kind"] == "summary" and "loop" not in r}
    for mode in ran:
        got = [s for s in samples if s["mode"] == mode]
        assert len(got) == 2, mode
        assert summary[mode]["steps"] == 2
        if mode != "none":
            assert all(s["blocking_secs"] >= 0 for s in got), mode
            assert summary[mode]["saves"] == 2
            assert mode in md.read_text()

    checks = {r["mode"]: r["results"] for r in recs if r["kind"] == "check"}
    assert checks["tierckpt-lazy"] == ["host:ok", "local:ok"]
    assert checks["tierckpt-sync"] == ["local:ok"]
    assert all(res.endswith(":ok") for m in ran if m != "none" for res in checks[m])

    probe = {(r["loop"], r["background"]) for r in recs if r["kind"] == "summary" and r.get("loop")}
    assert probe == {(lp, ph) for lp in ("python", "matmul") for ph in ("base", "stage", "demote")}
    assert not any(p.name.startswith("bench-train-") for p in tmp_path.iterdir())  # scratch removed
