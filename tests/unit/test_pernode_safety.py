"""``files: per_node`` where it can go wrong, in one process: settings that cannot work refused, a commit
retried after a full device, the sweep and the drop of node files against ``.old-`` copies and against
a writer racing them, a re-save's replaced node file reclaimed, and the node's exchange under a slow
creator, a rank failing before it, and a failing store (docs/distributed.md, "A per-node data file")."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_pernode import _coordinators
from tierckpt import Hierarchy
from tierckpt.errors import ConfigError, CoordinationError, DeviceFullError, TierIOError
from tierckpt.format.location import Location, encode_location, split_location
from tierckpt.format.manifest import FORMAT_VERSION, BlobEntry, Manifest, encode_manifest
from tierckpt.ranks.nodeplace import lay_out
from tierckpt.tiers import _filescratch, _filewrite
from tierckpt.tiers._filescratch import HOST, drop_unused_node_files
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.pfs import PfsTier


def _tier(path: Path, **kw: Any) -> PfsTier:
    return PfsTier("pfs", path, files="per_node", job="unit-job", **kw)


def _blobs(*sizes: int) -> list[BlobEntry]:
    return [BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes)]


def _manifest(rank: int, size: int = 8192) -> bytes:
    blobs = (BlobEntry("blob-00000.bin", size),) if size else ()
    m = Manifest(step=1, rank=rank, world_size=2, align=4096, blobs=blobs,
                 tensors=[], tree=b"\x80", has_pickle=False, version=FORMAT_VERSION)  # fmt: skip
    return encode_manifest(m)


def _node_files(step: Path) -> list[str]:
    return sorted(n for n in os.listdir(step) if n.startswith("node-")) if step.exists() else []


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# -- F7, F1: settings that cannot work --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"path": "{tmp}/r{rank}"}, r"tiers\[1\]\.path: files: per_node .* \{rank\}"),
        ({"path": "{tmp}/r{rank:05d}"}, r"tiers\[1\]\.path: files: per_node .* \{rank\}"),
        ({"path": "{tmp}/p", "capacity": "1GiB"}, r"tiers\[1\]\.capacity: files: per_node cannot go with a capacity"),
    ],
)
def test_per_node_refuses_a_rank_path_and_a_capacity(tmp_path: Path, entry: dict[str, str], named: str) -> None:
    tier = {"name": "pfs", "kind": "pfs", "options": {"files": "per_node"}, **entry}
    tier["path"] = tier["path"].replace("{tmp}", str(tmp_path))
    with pytest.raises(ConfigError, match=named):
        Hierarchy.from_config({"tiers": [{"name": "host", "kind": "host"}, tier]})
    with pytest.raises(ValueError, match="capacity"):
        PfsTier("pfs", tmp_path, files="per_node", capacity_bytes=1 << 30)
    ok = {**tier, "path": str(tmp_path / "n{node}")}
    ok.pop("capacity", None)
    Hierarchy.from_config({"tiers": [{"name": "host", "kind": "host"}, ok]}).close()  # {node} is fine


def test_per_node_refuses_on_full_wait(tmp_path: Path) -> None:
    tier = {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "p"), "options": {"files": "per_node"}}
    host = {"name": "host", "kind": "host"}
    with pytest.raises(
        ConfigError, match=r"policy\.on_full\.pfs: 'wait' cannot free room on a tier with files: per_node"
    ):
        Hierarchy.from_config({"tiers": [host, tier], "policy": {"on_full": {"pfs": "wait"}}})
    with pytest.raises(ConfigError, match=r"policy\.on_full\.pfs: 'wait'"):
        Hierarchy.from_config({"tiers": [host, {**tier, "on_full": "wait"}]})
    Hierarchy.from_config({"tiers": [host, tier], "policy": {"on_full": {"pfs": "fail"}}}).close()


class _Reclaimer:
    """Deletions of evicted copies still running: ``pending`` of them, each freeing room when settled."""

    def __init__(self, pending: int) -> None:
        self.pending, self.settled = pending, 0

    def settle(self, tier: str | None = None) -> bool:
        if not self.pending:
            return False
        self.pending -= 1
        self.settled += 1
        return True


@pytest.mark.parametrize("pending", [0, 1, 2])
def test_a_full_node_file_tier_waits_for_deletions_already_queued_then_fails(pending: int) -> None:
    import errno
    from types import SimpleNamespace

    from tierckpt.background.mover import Mover
    from tierckpt.errors import DeviceFullError

    tier = SimpleNamespace(name="pfs", node_files=True)
    reclaimer = _Reclaimer(pending)
    attempts = []

    def attempt() -> str:
        attempts.append(1)
        if reclaimer.settled == 2:  # the second deletion frees the room the write needs
            return "written"
        raise DeviceFullError(errno.ENOSPC, "No space left on device")

    mover = SimpleNamespace(reclaimer=reclaimer)
    mover._make_room = lambda *a: Mover._make_room(mover, *a)  # type: ignore[arg-type]
    if pending < 2:
        with pytest.raises(DeviceFullError):
            Mover.with_room(mover, tier, 3, attempt)  # type: ignore[arg-type]
        assert len(attempts) == pending + 1
    else:
        assert Mover.with_room(mover, tier, 3, attempt) == "written"  # type: ignore[arg-type]
        assert len(attempts) == 3


# -- F8: a copy without blobs pads nothing --------------------------------------------------------------
def test_a_copy_without_blobs_takes_no_room_and_no_padding(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        assert tier.node_part([]) == (0, 1)
        assert tier.node_part(_blobs(0, 0)) == (0, 1)
        parts = [list(tier.node_part(_blobs(8192))), list(tier.node_part([])), list(tier.node_part(_blobs(4096)))]
        assert lay_out(parts) == ([0, 8192, 8192], 12288)
        name = tier.create_node_file(1, 0, 8192)
        w = tier.reserve_at(CheckpointKey(1, 1), [], Location(name, 8191))  # no bytes: on no multiple
        w.commit(_manifest(1, 0))
        assert tier.holds(CheckpointKey(1, 1))
    finally:
        tier.close()


# -- F3: a full device at the manifest, then the retry -----------------------------------------------------
def test_a_commit_retried_after_a_full_device_at_the_manifest_publishes(tmp_path: Path, monkeypatch: Any) -> None:
    tier = _tier(tmp_path)
    real, calls = _filewrite.write_file, []

    def full_once(path: Path, data: bytes) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(_filewrite, "write_file", full_once)
    try:
        w = tier.reserve(CheckpointKey(1), _blobs(8192))
        with pytest.raises(DeviceFullError, match="tier 'pfs'"):
            w.commit(_manifest(0))
        w.commit(_manifest(0))  # room was made: the same writer commits again
        assert tier.holds(CheckpointKey(1)) and tier.copy_files(CheckpointKey(1))["layout"] == "per_node"
    finally:
        tier.close()


# -- F2: a node file named by an .old- copy -----------------------------------------------------------------
def _saved_with_dead_creator(root: Path) -> tuple[Path, str]:
    """Step 1 saved on a per-node tier, its node file renamed as a dead process of this host's."""
    with Hierarchy([_tier(root)]) as h:
        h.save({"w": torch.ones(1024)}, step=1).wait()
    step = root / "step-000000000001"
    (named,) = _node_files(step)
    dead = f"node-00000-{HOST}-{_dead_pid()}-89abcdef.data"
    os.rename(step / named, step / dead)
    p = step / "rank-00000" / "manifest"
    raw, _ = split_location(p.read_bytes())
    p.write_bytes(raw + encode_location(Location(dead, 0)))
    return step, dead


def test_the_node_file_of_an_interrupted_replaces_old_copy_is_kept(tmp_path: Path) -> None:
    step, dead = _saved_with_dead_creator(tmp_path)
    old = f".old-rank-00000-{HOST}-{_dead_pid()}-0123abcd"
    os.rename(step / "rank-00000", step / old)  # a replace killed between its two renames
    _tier(tmp_path).close()  # the sweep on open
    assert old in os.listdir(step) and dead in _node_files(step)
    drop_unused_node_files(step)  # an eviction's or an abort's drop
    assert dead in _node_files(step)
    os.rename(step / old, step / "rank-00000")  # put back by hand, as docs/format.md says: readable
    with Hierarchy([_tier(tmp_path)]) as h:
        assert torch.equal(h.restore()["w"], torch.ones(1024))


# -- F5: a drop racing a writer --------------------------------------------------------------------------
def test_a_drop_that_listed_before_a_writer_came_keeps_its_node_file(tmp_path: Path, monkeypatch: Any) -> None:
    tier = _tier(tmp_path)
    try:
        name = tier.create_node_file(1, 0, 8192)
        step = tmp_path / "step-000000000001"
        stale = os.listdir(step)  # the drop lists the step before the writer's scratch exists
        w = tier.reserve_at(CheckpointKey(1, 0), _blobs(8192), Location(name, 0))
        real, first = os.listdir, [True]

        def listdir(path: Any) -> list[str]:
            if first and Path(path) == step:
                first.clear()
                return list(stale)
            return real(path)

        monkeypatch.setattr(_filescratch.os, "listdir", listdir)
        drop_unused_node_files(step)
        monkeypatch.undo()
        assert _node_files(step) == [name]  # seen on its second look: renamed back
        w.commit(_manifest(0))
        assert tier.holds(CheckpointKey(1, 0))
    finally:
        tier.close()


def test_a_writer_whose_node_file_goes_after_its_check_takes_its_copy_back(tmp_path: Path, monkeypatch: Any) -> None:
    tier = _tier(tmp_path)
    real = _filewrite.FileWriter._write_manifest
    try:
        w = tier.reserve(CheckpointKey(1), _blobs(8192))
        step = tmp_path / "step-000000000001"

        def then_unlinked(self: Any, manifest: bytes) -> None:
            real(self, manifest)
            for n in _node_files(step):  # a drop that listed the step before this writer's scratch existed
                os.unlink(step / n)

        monkeypatch.setattr(_filewrite.FileWriter, "_write_manifest", then_unlinked)
        with pytest.raises(TierIOError, match="node file was removed .* taken back"):
            w.commit(_manifest(0))
        assert not tier.holds(CheckpointKey(1)) and not step.exists()
    finally:
        tier.close()


@pytest.mark.parametrize("host", [HOST, "otherhost"])
def test_a_dead_droppers_renamed_node_file_comes_back_when_a_copy_names_it(host: str, tmp_path: Path) -> None:
    step, dead = _saved_with_dead_creator(tmp_path)
    away = f".drop-{host}-{_dead_pid()}-{dead}"
    os.rename(step / dead, step / away)  # a drop killed between its rename and its second look
    _tier(tmp_path).close()
    assert _node_files(step) == [dead]
    with Hierarchy([_tier(tmp_path)]) as h:
        assert torch.equal(h.restore()["w"], torch.ones(1024))


def test_a_sweep_before_a_followers_scratch_exists_makes_it_fail_never_publish(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        made = tier.create_node_file(1, 0, 8192)
        step = tmp_path / "step-000000000001"
        dead = f"node-00000-{HOST}-{_dead_pid()}-0badcafe.data"
        os.rename(step / made, step / dead)  # its creator died after it sent the place; no scratch yet
        _tier(tmp_path).close()  # another process's sweep on open
        assert _node_files(step) == []
        with pytest.raises(TierIOError, match="cannot start step 1"):
            tier.reserve_at(CheckpointKey(1, 1), _blobs(8192), Location(dead, 0))
        assert not tier.holds(CheckpointKey(1, 1))
    finally:
        tier.close()


# -- F6: a re-save's replaced node file --------------------------------------------------------------------
def test_a_resaves_replaced_node_file_is_reclaimed_and_an_open_reader_still_reads_it(tmp_path: Path) -> None:
    tier = _tier(tmp_path, direct=False)  # the test's buffers are not aligned for O_DIRECT
    step = tmp_path / "step-000000000001"
    try:
        first = tier.create_node_file(1, 0, 16384)
        for rank, offset in ((0, 0), (1, 8192)):
            w = tier.reserve_at(CheckpointKey(1, rank), _blobs(8192), Location(first, offset))
            data = torch.full((2048,), float(rank + 1))
            w.write(0, 0, data.data_ptr(), 8192).result()
            w.commit(_manifest(rank))
        copy = tier.open_copy(CheckpointKey(1, 0))
        reader = copy.reader(_blobs(8192))  # opened before the re-save: a snapshot
        second = tier.create_node_file(1, 0, 16384)
        for rank, offset in ((0, 0), (1, 8192)):
            w = tier.reserve_at(CheckpointKey(1, rank), _blobs(8192), Location(second, offset))
            w.commit(_manifest(rank))
            # rank 1's old copy still names the first file after rank 0's re-save; after rank 1's, none
            assert _node_files(step) == sorted([first, second] if rank == 0 else [second])
        got = torch.empty(2048)
        reader.read(0, 0, got.data_ptr(), 8192).result()
        assert torch.equal(got, torch.ones(2048))  # rank 0's old bytes
        reader.close()
        copy.close()
        assert tier.used_bytes() == 16384 + sum(os.path.getsize(step / f"rank-{r:05d}" / "manifest") for r in (0, 1))
    finally:
        tier.close()


# -- F4: the node's exchange -----------------------------------------------------------------------------
def _run(calls: dict[int, Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            out[r] = calls[r]()
        except Exception as e:
            out[r] = e

    threads = {r: threading.Thread(target=run, args=(r,), daemon=True) for r in calls}
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(60)
    assert not any(t.is_alive() for t in threads.values()), "a rank of the node hangs"
    return out


def test_followers_wait_for_a_creator_slower_than_the_grace(tmp_path: Path) -> None:
    import time

    c = _coordinators(2, 1.0)

    def slow(values: list[Any]) -> list[Any]:
        time.sleep(3.0)  # making the file takes longer than the timeout and the grace
        return values

    out = _run({0: lambda: c[0].node_gather("k", 0, slow), 1: lambda: c[1].node_gather("k", 1, slow)})
    assert out == {0: [0, 1], 1: [0, 1]}


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_failing_before_the_exchange_fails_its_node_at_once_naming_it(failing: int) -> None:
    c = _coordinators(3, 600.0)  # nobody waits for the timeout

    def call(r: int) -> Any:
        if r == failing:
            return lambda: c[r].node_fail("k", "its source failed")
        return lambda: c[r].node_gather("k", r, list)

    out = _run({r: call(r) for r in range(3)})
    for r in range(3):
        if r != failing:
            assert isinstance(out[r], CoordinationError), out[r]
            assert f"rank {failing} failed before the node's exchange: its source failed" in str(out[r])
            assert out[r].ranks == (failing,)


def test_a_failing_store_is_a_coordination_error_naming_the_call() -> None:
    c = _coordinators(2, 5.0)

    class Dead:
        def __getattr__(self, name: str) -> Any:
            def fail(*a: Any, **k: Any) -> Any:
                raise RuntimeError("connection reset")

            return fail

    for co in c:
        co._local.store = Dead()  # this thread's client: its server went
    with pytest.raises(CoordinationError, match=r"'k' \(node exchange\): the store failed: connection reset"):
        c[0].node_gather("k", 0, list)
    with pytest.raises(CoordinationError, match=r"'k' \(node exchange\): the store failed"):
        c[1].node_gather("k", 1, list)


def test_a_failed_calls_keys_are_swept_after_the_linger() -> None:
    store = dist.HashStore()
    c = _coordinators(2, 0.5, store)
    before = store.num_keys()
    out = _run({0: lambda: c[0].node_gather("a", 0, list)})  # rank 1 never comes: a failure stays
    assert isinstance(out[0], CoordinationError)
    _run({1: lambda: c[1].node_gather("a", 1, list)})  # comes late: reads the failure, leaves values
    assert store.num_keys() > before
    c[0]._node().linger = 0.0
    assert _run({0: lambda: c[0].node_gather("b", 0, list), 1: lambda: c[1].node_gather("b", 1, list)}) == {
        0: [0, 1],
        1: [0, 1],
    }
    assert store.num_keys() == before  # the failure's and the late rank's keys, and b's, are gone
