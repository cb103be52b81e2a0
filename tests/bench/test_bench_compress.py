"""Smoke test of benchmarks/bench_compress.py: the small llm state and a model trained for two steps, each
method once; the ratios it reports (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.bench
def test_bench_compress_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_compress

    out = tmp_path / "compress.json"
    argv = ["--quick", "--steps", "2", "--repeats", "1", "--sample-mib", "0", "--cache", str(tmp_path / "cache")]
    assert bench_compress.main([*argv, "--out", str(out)]) == 0
    assert list((tmp_path / "cache").glob("gpt-*-2steps.pt"))  # trained once, then kept

    res = json.loads(out.read_text())
    assert set(res["sources"]) == {"llm", "trained"}
    for source in res["sources"].values():
        kinds = source["kinds"]
        assert set(kinds) == set(bench_compress.KINDS)
        for kind in ("bf16 weights", "fp32 master weights", "Adam exp_avg"):
            row = kinds[kind]
            # the exponent plane compresses, the low mantissa bytes are left raw; grouping beats plain zstd
            assert row["grouped-1"]["planes"][0] == "raw" and row["grouped-1"]["planes"][-1] != "raw"
            assert row["grouped-1"]["ratio"] > row["zstd-1"]["ratio"] > 1.0
            assert row["grouped-1-chosen"]["ratio"] == pytest.approx(row["grouped-1"]["ratio"], rel=0.02)
        assert kinds["bool"]["grouped-1"]["width"] == 1 and kinds["int64"]["grouped-1"]["width"] == 8
    assert res["sources"]["trained"]["info"]["steps"] == 2
    table = capsys.readouterr().out
    assert "| bf16 weights (bfloat16) |" in table and "**trained**" in table
