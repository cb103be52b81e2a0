"""Smoke test of benchmarks/bench_s3.py: 16 MiB transfers against the loopback radosgw it starts, one sweep
point, every raw client once, the tier where ``kind: s3`` exists, the peers where they install; no timing
assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.testing.clusters import why_ceph_cannot_run

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MIB = 1 << 20

pytestmark = [pytest.mark.bench, pytest.mark.remote]


@pytest.fixture(autouse=True)
def _needs_radosgw() -> None:
    why = why_ceph_cannot_run(rgw=True)
    if why is not None:
        pytest.skip(f"radosgw: {why}")
    pytest.importorskip("boto3")


def test_bench_s3_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_s3
    from s3_clients import DOWNLOADS, SWEPT_DOWNLOADS, SWEPT_UPLOADS, UPLOADS

    out = tmp_path / "out"
    argv = ["--bytes", "16MiB", "--parts", "8MiB", "--concs", "2", "--repeats", "1", "--tensor-bytes", "4MiB",
            "--memstore", "512MiB", "--out", str(out), "--dir", str(tmp_path)]  # fmt: skip
    assert bench_s3.main(argv) == 0

    (jsonl,) = out.glob("s3-*.jsonl")
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert recs[0]["kind"] == "machine" and recs[-1]["kind"] == "end"
    samples = [r for r in recs if r["kind"] == "sample"]
    gone = {r["what"].split()[1] for r in recs if r["kind"] == "skip" and r["what"].startswith("client ")}
    assert gone <= {c for c in UPLOADS + DOWNLOADS if c.startswith("obstore")}  # where obstore is missing
    sweep = {(r["op"], r["client"]): r for r in samples if r["phase"] == "sweep"}
    assert set(sweep) == {("put", c) for c in SWEPT_UPLOADS if c not in gone} | {
        ("get", c) for c in SWEPT_DOWNLOADS if c not in gone
    }
    raw = {(r["op"], r["client"]): r for r in samples if r["phase"] == "clients"}
    assert set(raw) == {("put", c) for c in UPLOADS if c not in gone} | {("get", c) for c in DOWNLOADS if c not in gone}
    for r in [*sweep.values(), *raw.values()]:
        assert r["ok"], r
        assert r["secs"] > 0 and r["cpu"] > 0 and r["server_cpu"] > 0 and r["extra_rss"] >= 0
        assert r["op"] == "put" or r["intact"]  # every download read back the pattern
    # the requests of one upload, counted in radosgw's log: two 8 MiB parts
    assert raw["put", "boto3"]["requests"] == {
        "CreateMultipartUpload": 1,
        "UploadPart": 2,
        "CompleteMultipartUpload": 1,
    }
    assert raw["get", "boto3"]["requests"] == {"GetObject": 2}
    assert raw["put", "boto3"]["part"] == 8 * MIB and raw["put", "boto3"]["conc"] == 2  # the sweep's only point

    tier = {r["op"]: r for r in samples if r["phase"] == "tier"}
    if any(r["kind"] == "skip" and r["what"] == "tier" for r in recs):
        assert not tier
    else:
        save, restore = tier["tier-save"], tier["tier-restore"]
        assert save["ok"] and restore["ok"] and restore["intact"], (save, restore)
        # two saves (the second evicts the first): two uploads of the 16 MiB state's blob, 2 parts each
        parts = [s["save"]["requests"].get("UploadPart", 0) for s in (save["first"], save)]
        assert parts == [2, 2] and restore["requests"].get("GetObject", 0) >= 2
    peers = {r["op"]: r for r in samples if r["phase"] == "peer"}
    assert {"dcp-fsspec-save", "s3torch-save"} <= set(peers)  # each ran, or failed with its reason recorded
    for r in peers.values():
        assert r["ok"] or r["error"]

    md = (out / Path(recs[-1]["md"]).name).read_text()
    assert "## Sweep: raw clients" in md and "## Raw clients at their best settings" in md and "## Targets" in md
    assert not any(p.name.startswith("bench-s3-") for p in tmp_path.iterdir())  # the server's files removed
