"""DCP's options across ranks through ``tierckpt.dcp`` (spawned gloo ranks): a coordinator other than rank 0
(its part holds the metadata record; ShardedTensors with several shards of one tensor on a rank, resharded on
load), every rank saving alone (``no_dist=True`` / ``use_collectives=False`` inside a group: per-rank records,
DCP's rank-local fallback on load), a hierarchy numbered differently from DCP's group, a subgroup with a
hierarchy over it, and a group that does not match the hierarchy (refused, saying how to build it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import spawn  # tests/multiproc/harness.py

dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ROWS, COLS = 12, 5
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _hierarchy(d: str, coordinator: Any = None, job: str = "dcp-options") -> Any:
    from tierckpt import Hierarchy

    cfg = {"tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": f"{d}/pfs"}]}
    return Hierarchy.from_config({**cfg, "distributed": {"timeout": 15}}, job=job, coordinator=coordinator)


def _sharded(placements: list[str], fill: bool) -> Any:
    """A ShardedTensor of FULL's shape chunked on dim 0 over ``placements`` (several shards on one rank where
    a rank appears twice), its local shards FULL's rows (``fill``) or zeros."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    st = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=placements), ROWS, COLS)  # type: ignore[arg-type]
    if fill:
        for shard in st.local_shards():
            r0, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            shard.tensor.copy_(FULL[r0 : r0 + n])
    return st


def _rows_match(st: Any) -> int:
    """How many local shards of ``st`` hold FULL's rows (asserting each does)."""
    for shard in st.local_shards():
        r0, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        assert torch.equal(shard.tensor, FULL[r0 : r0 + n]), (r0, n)
    return len(st.local_shards())


def _other_coordinator(rank: int, world: int, d: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import load, load_state_dict, save_state_dict

    from tierckpt.dcp import HierarchyReader, HierarchyWriter

    with _hierarchy(d) as h:
        sd = {"st": _sharded(["rank:0", "rank:1", "rank:1", "rank:0"], fill=True), "rep": torch.ones(3), "n": 5}
        assert len(sd["st"].local_shards()) == 2  # two shards of one tensor on each rank
        save_state_dict(sd, storage_writer=HierarchyWriter(h, step=1), coordinator_rank=1)
        entry = h.restore(1)["__dcp__"]
        holds = "metadata" in entry
        got = {"st": _sharded(["rank:1", "rank:0"], fill=False), "rep": torch.zeros(3), "n": 0}
        load_state_dict(got, storage_reader=HierarchyReader(h, step=1), coordinator_rank=1)
        shards = _rows_match(got["st"])
        assert torch.equal(got["rep"], torch.ones(3)) and got["n"] == 5
        again = {"st": _sharded(["rank:0", "rank:1"], fill=False), "rep": torch.zeros(3), "n": 0}
        load(again, storage_reader=HierarchyReader(h))  # DCP's coordinator 0 this time; the newest step
        _rows_match(again["st"])
        return {"holds": holds, "record_rank": entry.get("record_rank"), "shards": shards}


def test_a_coordinator_other_than_rank_0_keeps_the_record(tmp_path: Path) -> None:
    res = spawn(_other_coordinator, 2, tmp_path, str(tmp_path), limit=120)
    assert res[0] == {"ok": {"holds": False, "record_rank": 1, "shards": 1}}
    assert res[1] == {"ok": {"holds": True, "record_rank": None, "shards": 1}}


def _alone(rank: int, world: int, d: str, how: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import HierarchyReader, HierarchyWriter
    from tierckpt.errors import TierckptError

    option = {"no_dist": True} if how == "no_dist" else {"use_collectives": False}
    with _hierarchy(d) as h:
        sd = {"w": torch.full((4,), float(rank)), "who": f"rank-{rank}"}  # each rank's own state
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=2), **option)
        scope = h.restore(2)["__dcp__"]["scope"]
        try:
            HierarchyReader(h, step=2).read_metadata()
            refused = ""
        except TierckptError as e:
            refused = str(e)
        got = {"w": torch.zeros(4), "who": ""}
        dcp.load(got, storage_reader=HierarchyReader(h, step=2))  # DCP falls back to each rank's record
        mine = {"w": torch.zeros(4), "who": ""}
        dcp.load(mine, storage_reader=HierarchyReader(h, step=2), no_dist=True)
        same = torch.equal(got["w"], sd["w"]) and torch.equal(mine["w"], sd["w"])
        return {
            "scope": scope,
            "refused": "saved by each rank alone" in refused,
            "who": [got["who"], mine["who"]],
            "same": same,
        }


@pytest.mark.parametrize("how", ["no_dist", "use_collectives"])
def test_every_rank_saving_alone_keeps_its_own_record(tmp_path: Path, how: str) -> None:
    res = spawn(_alone, 2, tmp_path, str(tmp_path), how, limit=120)
    for r in (0, 1):
        assert res[r] == {"ok": {"scope": "rank", "refused": True, "who": [f"rank-{r}"] * 2, "same": True}}, res


def _dtensor_roundtrip(h: Any, step: int, group: Any = None) -> bool:
    """Save a Shard(0) DTensor of FULL over ``group``'s ranks and load it back as Shard(1): equal?"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tierckpt.dcp import HierarchyReader, HierarchyWriter

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mesh = DeviceMesh("cpu", ranks)
    sd = {"m": {"w": distribute_tensor(FULL, mesh, [Shard(0)])}, "step": step}
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=step), process_group=group)
    got = {"m": {"w": distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(1)])}, "step": -1}
    dcp.load(got, storage_reader=HierarchyReader(h, step=step), process_group=group)
    return bool(torch.equal(got["m"]["w"].full_tensor(), FULL)) and got["step"] == step


def _renumbered(rank: int, world: int, d: str) -> dict[str, Any]:
    from tierckpt import StoreCoordinator

    store = dist.distributed_c10d._get_default_store()
    coordinator = StoreCoordinator(store, world - 1 - rank, world, prefix="renumbered", timeout=15)
    with _hierarchy(d, coordinator) as h:
        ok = _dtensor_roundtrip(h, 3)
        return {"ok": ok, "hrank": h.rank, "holds": "metadata" in h.restore(3)["__dcp__"]}


def test_a_hierarchy_numbered_unlike_dcps_group(tmp_path: Path) -> None:
    res = spawn(_renumbered, 2, tmp_path, str(tmp_path), limit=120)
    # DCP's coordinator is its rank 0: hierarchy rank 1 there, whose part holds the record
    assert res == [{"ok": {"ok": True, "hrank": 1, "holds": True}}, {"ok": {"ok": True, "hrank": 0, "holds": False}}]


def _subgroup(rank: int, world: int, d: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tierckpt import StoreCoordinator
    from tierckpt.dcp import HierarchyWriter

    group = dist.new_group([1, 2])  # every rank takes part in making it
    out: dict[str, Any] = {}
    with _hierarchy(d, job="whole") as whole:  # every rank: a hierarchy of the 3
        if rank in (1, 2):
            try:  # a group of 2 of its 3 ranks: refused before anything is written
                dcp.save({"t": torch.ones(2)}, storage_writer=HierarchyWriter(whole, step=4), process_group=group)
            except CheckpointException as e:
                out["refused"] = "DCP's process group has 2 ranks" in str(e) and "world_size 3" in str(e)
            out["written"] = [c.step for c in whole.checkpoints()]
        if rank == 0:
            return {"idle": True}
        store = dist.distributed_c10d._get_default_store()
        sub = StoreCoordinator(store, dist.get_rank(group), 2, prefix="sub", timeout=15)
        with _hierarchy(f"{d}/sub", sub, job="sub") as h:  # the subgroup's own hierarchy
            out["roundtrip"] = _dtensor_roundtrip(h, 5, group)
    return out


def test_a_subgroup_with_its_own_hierarchy(tmp_path: Path) -> None:
    res = spawn(_subgroup, 3, tmp_path, str(tmp_path), limit=150)
    assert res[0] == {"ok": {"idle": True}}
    for r in (1, 2):
        assert res[r] == {"ok": {"refused": True, "written": [], "roundtrip": True}}, res


def _one_alone(rank: int, world: int, d: str) -> str:
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tierckpt import Hierarchy
    from tierckpt.dcp import HierarchyWriter

    cfg = {"tiers": [{"name": "pfs", "kind": "pfs", "path": f"{d}/pfs"}], "distributed": {"timeout": 3}}
    with Hierarchy.from_config(cfg, job="one-alone") as h:
        if rank == 1:
            time.sleep(8)  # takes no part in the save
            return "idle"
        try:
            dcp.save({"w": torch.ones(2)}, storage_writer=HierarchyWriter(h, step=7), no_dist=True)
        except CheckpointException as e:
            return str(e).splitlines()[-1]
        return "saved"


def test_one_rank_saving_alone_into_a_hierarchy_of_two_fails_naming_the_other(tmp_path: Path) -> None:
    res = spawn(_one_alone, 2, tmp_path, str(tmp_path), limit=60)
    assert res[1] == {"ok": "idle"}
    assert res[0] is not None and "rank(s) 1 did not arrive" in res[0]["ok"], res  # the step is never committed
