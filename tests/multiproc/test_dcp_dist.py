"""The DCP backend across ranks (gloo on CPU, spawned processes): a DTensor state saved by 4 ranks through
``HierarchyWriter`` (``dcp.save`` and ``dcp.async_save``) into one shared tier directory, loaded back on 4
ranks and, resharded, on 2; every value compared with the same state written by DCP's own
``FileSystemWriter`` and read back by its ``FileSystemReader``."""

from __future__ import annotations

import datetime
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - a torch without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

_TIMEOUT = 90.0


def _spawn(fn: Any, nprocs: int, *args: Any) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` spawned processes; a failure or a hang fails the test."""
    # from a fork server that imported torch once (fresh, single-threaded processes, none importing torch
    # again: 4 interpreters importing torch at once on a small machine take longer than the test)
    mp.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "tierckpt.dcp"])
    ctx = mp.start_processes(fn, args=(nprocs, *args), nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + _TIMEOUT
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{nprocs} ranks did not finish within {_TIMEOUT} s")


def _init(rank: int, world: int, tmp: str, name: str) -> None:
    warnings.simplefilter("ignore")  # DCP warns about its own deprecations
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/{name}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def _hierarchy(tmp: str, readonly: bool = False) -> Any:
    from tierckpt import Hierarchy

    # every rank reads every rank's part from the one shared directory; host memory holds its own
    cfg = {
        "tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": f"{tmp}/pfs"}],
        "distributed": {"timeout": 8},  # a rank whose save fails before it writes: the others give up in 8 s
    }
    return Hierarchy.from_config(cfg, readonly=readonly, job=None if readonly else "dcp-test")


def _full(seed: int) -> dict[str, torch.Tensor]:
    """The global tensors (the same on every rank): uneven sizes, several dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(10, 6, generator=g),  # 10 rows on 4 ranks: 3, 3, 3, 1
        "v": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "rep": torch.randint(0, 100, (4, 3), generator=g),
    }


def _sharded(full: dict[str, torch.Tensor], mesh: Any, w_dim: int, v_dim: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(w_dim)]),
            "v": distribute_tensor(full["v"], mesh, [Shard(v_dim)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        },
        "step": 0,
        "note": "",
        "blob": {"a": (0, 0)},
    }


def _plain(seed: int) -> dict[str, Any]:
    return {"step": seed, "note": f"run-{seed}", "blob": {"a": (seed, "tuple")}}


def _zeros(full: dict[str, torch.Tensor], mesh: Any, w_dim: int, v_dim: int) -> dict[str, Any]:
    return _sharded({k: torch.zeros_like(t) for k, t in full.items()}, mesh, w_dim, v_dim)


def _check(got: dict[str, Any], full: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    for k, want in full.items():
        t = got["model"][k].full_tensor()
        assert t.dtype == want.dtype and torch.equal(t, want), k
    for k, want in plain.items():
        assert got[k] == want, (k, got[k], want)


def _save4(rank: int, world: int, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt.dcp import HierarchyReader, HierarchyWriter

    _init(rank, world, tmp, "save")
    mesh = init_device_mesh("cpu", (world,))
    with _hierarchy(tmp) as h:
        assert (h.rank, h.world_size) == (rank, world)
        sd = {**_sharded(_full(1), mesh, 0, 1), **_plain(1)}
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=1))
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{tmp}/fs1"))  # DCP's own, for comparison
        sd2 = {**_sharded(_full(2), mesh, 1, 0), **_plain(2)}
        fut = dcp.async_save(sd2, storage_writer=HierarchyWriter(h, step=2))
        assert isinstance(fut, Future)  # DCP's own staging: the save goes on in its thread
        assert isinstance(fut, Future)  # DCP's own staging: the save goes on in its thread
        fut.result(timeout=60)
        dcp.save(sd2, storage_writer=dcp.FileSystemWriter(f"{tmp}/fs2"))

        # each rank wrote one part per step, in the shared directory; every rank's listing has both
        assert [c.step for c in h.checkpoints()] == [1, 2]
        assert all(err is None for _, _, err in h.verify(1)) and all(err is None for _, _, err in h.verify(2))
        parts = sorted(p.name for p in Path(f"{tmp}/pfs").glob("step-*1/rank-*"))
        assert len(parts) == world, parts
        # h.restore: this rank's part: its local shards at their key paths, DCP's entry beside them
        mine = h.restore(1)
        assert torch.equal(mine["model"]["w"], sd["model"]["w"].to_local())
        assert mine["__dcp__"]["rank"] == rank and ("metadata" in mine["__dcp__"]) == (rank == 0)

        # a save that fails on one rank (an object DCP cannot serialize) leaves no metadata: rank 0's part,
        # the commit record, is never written, and the newest step that loads is still 2
        bad = {**sd2, "only3": (lambda: 0) if rank == 3 else 0}
        with pytest.raises(CheckpointException):
            dcp.save(bad, storage_writer=HierarchyWriter(h, step=3))
        assert not Path(f"{tmp}/pfs/step-000000000003/rank-00000").exists()

        # loaded back on the same 4 ranks, with the save's placements and another's
        for step, seed, w_dim, v_dim in ((1, 1, 1, 0), (2, 2, 0, 0), (None, 2, 1, 1)):
            got = _zeros(_full(seed), mesh, w_dim, v_dim)
            dcp.load(got, storage_reader=HierarchyReader(h, step=step))
            _check(got, _full(seed), _plain(seed))
    dist.destroy_process_group()


def _load2(rank: int, world: int, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt.dcp import HierarchyReader

    _init(rank, world, tmp, "load")
    mesh = init_device_mesh("cpu", (world,))
    with _hierarchy(tmp, readonly=True) as h:  # an evaluation job on 2 ranks reads the 4 ranks' parts
        for step in (1, 2):
            ours = _zeros(_full(step), mesh, 1, 0)
            dcp.load(ours, storage_reader=HierarchyReader(h, step=step))
            stock = _zeros(_full(step), mesh, 1, 0)
            dcp.load(stock, storage_reader=dcp.FileSystemReader(f"{tmp}/fs{step}"))
            _check(ours, _full(step), _plain(step))
            for k in ours["model"]:  # value by value, the same as what DCP's own writer and reader give
                assert torch.equal(ours["model"][k].to_local(), stock["model"][k].to_local()), k
            assert {k: v for k, v in ours.items() if k != "model"} == {k: v for k, v in stock.items() if k != "model"}
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 saved by 4 ranks (and loaded back by them: the assertions of :func:`_save4`)."""
    tmp = tmp_path_factory.mktemp("dcp4")
    _spawn(_save4, 4, str(tmp))
    return tmp


def test_a_dtensor_state_saved_on_4_ranks_loads_back_on_4(saved: Path) -> None:
    parts = {p.name: sorted(r.name for r in p.iterdir()) for p in (saved / "pfs").glob("step-*")}
    every = [f"rank-{r:05d}" for r in range(4)]
    # step 3 failed on rank 3: never committed on any tier, and every rank removed its part of it
    assert parts == {"step-000000000001": ["commit", *every], "step-000000000002": ["commit", *every]}


def test_resharded_load_on_2_ranks_equals_dcps_own(saved: Path) -> None:
    _spawn(_load2, 2, str(saved))


def _sharded_tensors(rank: int, world: int, tmp: str) -> None:
    """Several shards of one ShardedTensor on one rank: the second one has no key path of its own and is
    kept in that rank's ``__dcp__`` entry (rank 0's holds the metadata record too)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from tierckpt.dcp import HierarchyReader, HierarchyWriter

    _init(rank, world, tmp, "sharded")
    specs = {
        "a": ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:0/cpu"]),
        "b": ChunkShardingSpec(dim=1, placements=["rank:1/cpu", "rank:1/cpu", "rank:0/cpu"]),
    }

    def state(fill: bool) -> dict[str, Any]:
        sd: dict[str, Any] = {name: empty(spec, 6, 6) for name, spec in specs.items()}
        for st in sd.values():
            for shard in st.local_shards():
                off = shard.metadata.shard_offsets
                shard.tensor.copy_(shard.tensor.new_full(shard.tensor.shape, 100.0 * off[0] + off[1] if fill else 0))
        return {**sd, "n": 3 if fill else 0}

    with _hierarchy(tmp) as h:
        saved = state(True)
        dcp.save(saved, storage_writer=HierarchyWriter(h, step=1))
        got = state(False)
        dcp.load(got, storage_reader=HierarchyReader(h, step=1))
        for name in specs:
            want = [s.tensor for s in saved[name].local_shards()]
            assert all(torch.equal(a.tensor, b) for a, b in zip(got[name].local_shards(), want, strict=True)), name
        assert got["n"] == 3
    dist.destroy_process_group()


def test_two_shards_of_one_sharded_tensor_on_one_rank_round_trip_on_2_ranks(tmp_path: Path) -> None:
    _spawn(_sharded_tensors, 2, str(tmp_path))


class _Slow:
    """A gate that holds each call for a while (a slow shared file system's commit)."""

    def wait(self) -> None:
        time.sleep(1.5)


def _two_nodes(rank: int, world: int, tmp: str) -> None:
    """Rank r on node r: host memory, the node's own ssd, a shared pfs whose commits are slow."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tierckpt import Hierarchy
    from tierckpt.dcp import HierarchyReader, HierarchyWriter
    from tierckpt.io import make_engine
    from tierckpt.testing import FaultyTier
    from tierckpt.tiers.host import HostTier
    from tierckpt.tiers.local import LocalTier
    from tierckpt.tiers.pfs import PfsTier

    os.environ["TIERCKPT_NODE"] = str(rank)
    _init(rank, world, tmp, "nodes")
    engine = make_engine("threads", 4)
    pfs = FaultyTier(PfsTier("pfs", f"{tmp}/pfs", engine, job="j"), gates={"commit": _Slow()})
    tiers = [HostTier("host"), LocalTier("ssd", f"{tmp}/node{rank}/ssd", engine, job="j"), pfs]
    sd = {"w": torch.arange(8.0), "n": 3}  # replicated: DCP writes it once, into rank 0's part
    with Hierarchy(tiers, job="j") as h:
        # saved, and listed on every rank, before it is on the shared tier: rank 1 cannot load it yet,
        # and says why (rank 0's part, with DCP's metadata, is only on node 0's tiers)
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=1, durable="top"))
        assert [c.step for c in h.checkpoints()] == [1]
        try:
            dcp.load({"w": torch.zeros(8), "n": 0}, storage_reader=HierarchyReader(h, step=1))
        except CheckpointException as e:
            assert "none of rank 1's tiers (host, ssd, pfs) holds rank 0's part" in str(e), str(e)
            assert "on a shared tier (pfs)" in str(e), str(e)
        else:
            raise AssertionError("step 1 loaded on rank 1 before it reached the shared tier")
        # the default durability: dcp.save returns once every rank can load the step
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=2))
        got = {"w": torch.zeros(8), "n": 0}
        dcp.load(got, storage_reader=HierarchyReader(h, step=2))
        assert torch.equal(got["w"], sd["w"]) and got["n"] == 3
    engine.close()
    dist.destroy_process_group()


def test_a_step_dcp_save_returned_for_loads_on_every_rank_of_every_node(tmp_path: Path) -> None:
    _spawn(_two_nodes, 2, str(tmp_path))


def _one_node(rank: int, world: int, tmp: str) -> None:
    """Both ranks on node 0: host memory, the node's ssd (one directory, shared by the node's ranks), a
    pfs whose commits wait for the test; then an ssd directory of each rank's own."""
    import os
    import threading

    import torch.distributed.checkpoint as dcp

    from tierckpt import Hierarchy
    from tierckpt.dcp import HierarchyReader, HierarchyWriter
    from tierckpt.io import make_engine
    from tierckpt.testing import FaultyTier
    from tierckpt.tiers.host import HostTier
    from tierckpt.tiers.local import LocalTier
    from tierckpt.tiers.pfs import PfsTier

    os.environ["TIERCKPT_NODE"] = "0"
    _init(rank, world, tmp, "one-node")
    engine = make_engine("threads", 4)
    sd = {"w": torch.arange(8.0), "n": 3}  # replicated: DCP writes it once, into rank 0's part
    for ssd_dir, step in ((f"{tmp}/node0/ssd", 1), (f"{tmp}/rank{rank}/ssd", 2)):
        held = threading.Event()
        pfs = FaultyTier(PfsTier("pfs", f"{tmp}/pfs", engine, job="j"), gates={"commit": held})
        tiers = [HostTier("host"), LocalTier("ssd", ssd_dir, engine, job="j"), pfs]
        # each rank's own ssd: no tier but pfs holds every part, so the save waits until pfs may commit
        # (after 1.5 s); the node's one ssd: it returns at once (a save that waits anyway returns after 20 s)
        timer = threading.Timer(1.5 if step == 2 else 20.0, held.set)
        timer.start()
        try:
            with Hierarchy(tiers, job="j") as h:
                dcp.save(sd, storage_writer=HierarchyWriter(h, step=step))  # the default durability
                on_pfs = [k.step for k in pfs.list_committed(0)]
                assert (step in on_pfs) == (step == 2), (step, on_pfs)  # one node: its shared ssd is enough
                got = {"w": torch.zeros(8), "n": 0}
                dcp.load(got, storage_reader=HierarchyReader(h, step=step))  # every rank loads it at once
                assert torch.equal(got["w"], sd["w"]) and got["n"] == 3
                held.set()
        finally:
            timer.cancel()
            held.set()
        dist.barrier()
    engine.close()
    dist.destroy_process_group()


def test_on_one_node_dcp_save_returns_once_the_node_local_tier_has_the_step(tmp_path: Path) -> None:
    _spawn(_one_node, 2, str(tmp_path))
