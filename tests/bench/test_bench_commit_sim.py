"""Smoke test of benchmarks/bench_commit_sim.py: both layouts at a few ranks, their counts per checkpoint
as docs/distributed.md ("Files and metadata operations per checkpoint") states them; no timings."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.bench
@pytest.mark.parametrize(("n", "per_node"), [(4, 4), (6, 4)])
def test_commit_sim_counts_both_layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, per_node: int) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_commit_sim

    nodes = -(-n // per_node)
    per_rank = bench_commit_sim.one_size(n, tmp_path / "a", "per_rank")
    per_node_rows = bench_commit_sim.one_size(n, tmp_path / "b", "per_node", per_node)

    def kinds(rows: dict) -> dict:
        return rows["write copies"]["kinds"] + rows["commit (report + record)"]["kinds"]

    a, b = kinds(per_rank), kinds(per_node_rows)
    # one data file a rank, or a node; a manifest a rank either way; the commit record
    assert (per_rank["data files"], per_node_rows["data files"]) == (n, nodes)
    assert a["file creates"] == 2 * n + 1 and b["file creates"] == n + nodes + 1
    assert a["opens of existing files"] == 0 and b["opens of existing files"] == n  # each rank opens its node's file
    assert a["renames"] == b["renames"] == n + 1
    assert b["file fsyncs"] == a["file fsyncs"] and b["mkdirs"] == a["mkdirs"]
    assert b["directory fsyncs"] == a["directory fsyncs"] + nodes  # the creator's, of the new file's name
    # entries: the step directory, the record, each rank's directory and manifest, and the data files
    assert per_rank["entries"] == 2 + 3 * n and per_node_rows["entries"] == 2 + 2 * n + nodes
    # the per-node exchange: every rank sets its size and reads the place; each creator waits, reads the others'
    write_ops = per_node_rows["write copies"]["store ops"]
    assert per_rank["write copies"]["store ops"] == 0 and write_ops == 2 * n + sum(
        1 + min(per_node, n - f) for f in range(0, n, per_node)
    )
