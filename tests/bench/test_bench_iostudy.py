"""Smoke test of benchmarks/bench_iostudy.py: tiny sizes, one repeat, 2 ranks (1 is the same code), a few variants, on a
temporary directory; every restore checked byte for byte by the script itself. No timing assertions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tierckpt.bench.iostudy import make_variant, plain_facts
from tierckpt.io.geometry import FsFacts

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.bench
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
def test_bench_iostudy_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_iostudy

    out = tmp_path / "out"
    variants = ["tierckpt:detected", "tierckpt:default:buffered", "uncoalesced", "uncoalesced:direct",
                "datastates", "torch.save", "dcp-t1", "dcp-t2"]  # fmt: skip
    argv = ["--dir", str(tmp_path / "mnt"), "--llm-gb", "0.01", "--small-count", "64", "--repeats", "1",
            "--ranks", "2", "--variants", *variants, "--out", str(out)]  # fmt: skip
    assert bench_iostudy.main(argv) == 0

    info = json.loads((out / "iostudy.json").read_text())
    (m,) = info["mounts"]
    assert sorted(m["cases"]) == ["llm/2", "small/2"]
    for case in m["cases"].values():
        assert set(case["save"]) == {*variants, "fio", "fio:buffered"}
        assert set(case["restore"]) == {*variants, "fio"} - {"dcp-t1", "dcp-t2"} | {"dcp.load"}
        assert all(s > 0 for v in case["save"].values() for s in v)
        g = case["info"]["tierckpt:detected"]["geometry"]
        assert g["alignment_bytes"] >= 4096 and g["direct"] == m["facts"]["direct"]
        assert case["info"]["tierckpt:default:buffered"]["geometry"]["direct"] is False
    md = (out / "iostudy.md").read_text()
    assert "| tierckpt:detected |" in md and "Targets:" in md and "× `dcp.save`" in md
    assert not (tmp_path / "mnt" / "bench-iostudy").exists()  # scratch removed


def test_plain_facts_keep_only_direct_io() -> None:
    f = FsFacts(block_bytes=4 << 20, io_block_bytes=4 << 20, direct=True, dio_mem_align=512, fs_type="fuse.ceph-fuse",
                family="cephfs", stripe_unit_bytes=4 << 20, stripe_count=1, object_bytes=4 << 20)  # fmt: skip
    p = plain_facts(f)
    assert p == FsFacts(direct=True, dio_mem_align=512)
    assert p.fs_block_bytes == 4096


@pytest.mark.parametrize("direct", [False, True])
def test_uncoalesced_round_trip(tmp_path: Path, direct: bool) -> None:
    """A naive writer's file reads back into the same tensors (odd sizes, a 0-dim and an empty one)."""
    import torch

    flat = {"a": torch.arange(1001, dtype=torch.int16), "b": torch.tensor(3.5), "c": torch.empty(0),
            "d": torch.randn(7, 5).to(torch.bfloat16)}  # fmt: skip
    name = "uncoalesced:direct" if direct else "uncoalesced"
    try:
        v = make_variant(name, tmp_path, 0, 1)
        v.save(flat, 0)
    except OSError as e:  # O_DIRECT refused here (tmpfs)
        pytest.skip(f"O_DIRECT: {e}")
    got = v.restore(0, flat)
    assert got.keys() == flat.keys() and all(torch.equal(got[k], flat[k]) for k in flat)
    ds = make_variant("datastates", tmp_path, 0, 1)
    ds.save(flat, 0)
    got = ds.restore(0, flat)
    ds.close()
    assert all(torch.equal(got[k], flat[k]) for k in flat)
