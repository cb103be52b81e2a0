"""``files: per_node`` in one process: the location block, the regions' layout, the node's gather on a
store (ranks as threads), and the file tier's node files: a writer whose node file went, the sweep, eviction
and capacity (docs/distributed.md, "A per-node data file")."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tierckpt import Hierarchy
from tierckpt.errors import CoordinationError, CorruptCheckpointError, TierIOError
from tierckpt.format.location import Location, decode_location, encode_location, split_location
from tierckpt.format.manifest import FORMAT_VERSION, BlobEntry, Manifest, encode_manifest
from tierckpt.ranks.distributed import StoreCoordinator
from tierckpt.ranks.nodeplace import lay_out
from tierckpt.tiers._filescratch import HOST
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.pfs import PfsTier

NAME = "node-00000-host_a-12-0123abcd.data"


def test_a_location_block_round_trips_and_every_damage_is_named() -> None:
    block = encode_location(Location(NAME, 8192))
    assert decode_location(block) == Location(NAME, 8192)
    for i in range(len(block)):  # one flipped bit anywhere: refused, never another place
        bad = bytearray(block)
        bad[i] ^= 0x10
        with pytest.raises(CorruptCheckpointError, match="no location block"):
            decode_location(bytes(bad))
    for cut in (block[:-1], block + b"\0", block[:10]):
        with pytest.raises(CorruptCheckpointError):
            decode_location(cut)
    for name in ("../x.data", "node-1-a-1-0.data", "node-00000-a/b-1-0123abcd.data"):
        with pytest.raises(ValueError):
            encode_location(Location(name, 0))


def test_split_location_leaves_what_is_not_a_manifest_alone() -> None:
    assert split_location(b"only a manifest") == (b"only a manifest", None)
    with Hierarchy.from_config({"tiers": [{"name": "h", "kind": "host"}]}) as h:
        h.save({"w": torch.ones(2)}, step=1).wait()
        manifest = h.tier("h").read_manifest(CheckpointKey(1))
    assert split_location(manifest) == (manifest, None)
    assert split_location(manifest + encode_location(Location(NAME, 0))) == (manifest, Location(NAME, 0))
    with pytest.raises(CorruptCheckpointError, match="bad magic"):
        split_location(manifest + b"x" * 40)


def test_regions_start_on_their_unit_in_rank_order() -> None:
    assert lay_out([[4096, 4096], [100, 512], [0, 4096], [8192, 8192]]) == ([0, 4096, 8192, 8192], 16384)
    with pytest.raises(ValueError, match="rank 1 of the node sent"):
        lay_out([[1, 1], [5, 0]])


def _coordinators(n: int, timeout: float, store: Any = None) -> list[StoreCoordinator]:
    store = store or dist.HashStore()
    made: list[Any] = [None] * n

    def build(r: int) -> None:
        made[r] = StoreCoordinator(store, r, n, timeout=timeout, node=0)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made


def _run(coords: list[StoreCoordinator], call: Any, ranks: list[int]) -> dict[int, Any]:
    out: dict[int, Any] = {}

    def go(r: int) -> None:
        try:
            out[r] = call(coords[r])
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_node_gather_runs_on_the_nodes_first_rank_and_every_rank_gets_its_result() -> None:
    coords = _coordinators(3, 5.0)
    seen: list[Any] = []

    def first(values: list[Any]) -> Any:
        seen.append(values)
        return {"sum": sum(values)}

    got = _run(coords, lambda c: c.node_gather("place/pfs/1/1", 10 + c.rank, first), [0, 1, 2])
    assert got == {0: {"sum": 33}, 1: {"sum": 33}, 2: {"sum": 33}} and seen == [[10, 11, 12]]


def test_a_rank_that_never_comes_fails_the_node_boundedly_naming_it() -> None:
    coords = _coordinators(3, 1.0)
    got = _run(coords, lambda c: c.node_gather("place/pfs/2/1", c.rank, sum), [0, 1])  # rank 2 never comes
    assert isinstance(got[0], CoordinationError) and got[0].ranks == (2,)
    assert "rank(s) 2 of the node did not arrive" in str(got[0])
    assert isinstance(got[1], CoordinationError) and "did not arrive" in str(got[1])
    late = _run(coords, lambda c: c.node_gather("place/pfs/2/1", c.rank, sum), [2])  # arrives after it failed
    assert isinstance(late[2], CoordinationError) and "did not arrive" in str(late[2])


def test_the_first_ranks_failure_reaches_the_others() -> None:
    coords = _coordinators(2, 5.0)

    def fails(values: list[Any]) -> Any:
        raise OSError(28, "No space left on device")

    got = _run(coords, lambda c: c.node_gather("place/pfs/3/1", 1, fails), [0, 1])
    assert isinstance(got[0], OSError) and not isinstance(got[0], CoordinationError)  # its own error
    assert isinstance(got[1], CoordinationError) and "No space left on device" in str(got[1])


def _tier(path: Path, **kw: Any) -> PfsTier:
    return PfsTier("pfs", path, files="per_node", job="unit-job", **kw)


def _blobs(*sizes: int) -> list[BlobEntry]:
    return [BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes)]


def _names(step: Path) -> list[str]:
    return sorted(n.split("-")[0] for n in os.listdir(step)) if step.exists() else []


def test_a_writer_whose_node_file_was_unlinked_publishes_nothing(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        w = tier.reserve(CheckpointKey(2), _blobs(8192))  # alone: a node file of its own
        step = tmp_path / "step-000000000002"
        (node,) = [n for n in os.listdir(step) if n.startswith("node-")]
        os.unlink(step / node)  # swept or evicted under the writer
        with pytest.raises(TierIOError, match="node file was removed"):
            w.commit(_manifest(0))
        assert not tier.holds(CheckpointKey(2)) and _names(step) == []
        w = tier.reserve(CheckpointKey(2), _blobs(8192))
        w.commit(_manifest(0))  # the same, left alone: published, its location block naming the file
        assert tier.holds(CheckpointKey(2)) and tier.copy_files(CheckpointKey(2))["layout"] == "per_node"
    finally:
        tier.close()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_sweep_removes_a_dead_creators_node_file_that_no_copy_names(tmp_path: Path) -> None:
    with Hierarchy([_tier(tmp_path)]) as h:
        h.save({"w": torch.ones(1024)}, step=1).wait()
    step = tmp_path / "step-000000000001"
    (named,) = [n for n in os.listdir(step) if n.startswith("node-")]
    dead = _dead_pid()
    orphan = f"node-00000-{HOST}-{dead}-0123abcd.data"
    other_host = f"node-00000-otherhost-{dead}-0123abcd.data"
    for n in (orphan, other_host):
        (step / n).write_bytes(b"\0" * 4096)
    os.rename(step / named, step / f"node-00000-{HOST}-{dead}-89abcdef.data")  # the named one: creator dead too
    p = step / "rank-00000" / "manifest"
    raw, _ = split_location(p.read_bytes())
    p.write_bytes(raw + encode_location(Location(f"node-00000-{HOST}-{dead}-89abcdef.data", 0)))
    live = step / f".tmp-rank-00001-{HOST}-{os.getpid()}-0000aaaa"
    live.mkdir()  # a writer of this host still at work: nothing is swept
    _tier(tmp_path).close()
    assert orphan in os.listdir(step)
    live.rmdir()
    _tier(tmp_path).close()
    left = os.listdir(step)
    assert orphan not in left  # a dead creator's, named by no copy
    assert other_host in left  # another host's: its creator cannot be told dead from here
    assert f"node-00000-{HOST}-{dead}-89abcdef.data" in left  # named by rank 0's manifest
    with Hierarchy([_tier(tmp_path)]) as h:
        assert torch.equal(h.restore()["w"], torch.ones(1024))


def test_eviction_removes_the_node_file_with_the_steps_last_copy_and_capacity_counts_it_once(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        w = tier.reserve_at(CheckpointKey(1, 0), _blobs(8192), Location(tier.create_node_file(1, 0, 16384), 0))
        w.abort()  # the region's writer failed: no copy, no writer left, so the node file goes
        assert _names(tmp_path / "step-000000000001") == []
        name = tier.create_node_file(1, 0, 16384)
        assert tier.used_bytes() == 16384  # counted from its creation, once
        for rank, offset in ((0, 0), (1, 8192)):
            w = tier.reserve_at(CheckpointKey(1, rank), _blobs(8192), Location(name, offset))
            w.commit(_manifest(rank))
        assert tier.used_bytes() == 16384 + 2 * len(_manifest(0) + encode_location(Location(name, 0)))
        tier.evict(CheckpointKey(1, 0), free=False)
        tier.reclaim()
        assert _names(tmp_path / "step-000000000001") == ["node", "rank"]  # rank 1's copy still uses it
        tier.evict(CheckpointKey(1, 1))
        assert not (tmp_path / "step-000000000001").exists()
    finally:
        tier.close()


def _manifest(rank: int) -> bytes:
    m = Manifest(step=1, rank=rank, world_size=2, align=4096, blobs=(BlobEntry("blob-00000.bin", 8192),),
                 tensors=[], tree=b"\x80", has_pickle=False, version=FORMAT_VERSION)  # fmt: skip
    return encode_manifest(m)
