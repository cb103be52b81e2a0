"""DTensor states saved by 4 spawned gloo ranks and restored on 4, 2, 8 and 1 ranks with other
placements (docs/distributed.md, "Sharded states and resharding"): uneven shards, 1-D and 2-D meshes,
Shard(0) -> Shard(1), replicated shards written once, and FSDP2 + AdamW through ``get_state_dict``."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import fsdp_mlp  # tests/multiproc/harness.py

from tierckpt import Hierarchy
from tierckpt.datapath import packing
from tierckpt.format.manifest import decode_manifest
from tierckpt.io import make_engine
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.testing.tamper import blob_file
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.pfs import PfsTier

CHUNK = 4096  # small checksum chunks, so that small tensors span several
# name -> (global shape, dtype, the mesh it is saved on (1: 1-D, 2: 2-D), saved placements)
SAVED: dict[str, tuple[tuple[int, ...], torch.dtype, int, str]] = {
    "s0": ((10, 6), torch.float32, 1, "S0"),  # 3, 3, 3, 1 rows
    "s1": ((5, 7), torch.float32, 1, "S1"),  # 2, 2, 2, 1 columns
    "rep": ((3, 3), torch.float32, 1, "R"),
    "m2": ((6, 5), torch.float32, 2, "S0,S1"),
    "m2r": ((9, 4), torch.float32, 2, "R,S0"),
    "big": ((64, 256), torch.float32, 1, "S0"),  # 16 KiB a rank: 4 chunks each
    "bf": ((7,), torch.bfloat16, 1, "S0"),
    "empty": ((3, 2), torch.float64, 1, "S0"),  # rank 3's shard is empty
}
# how a restoring job shards each one (other placements than saved)
RESTORED = {"s0": (1, "S1"), "s1": (1, "S0"), "rep": (1, "S0"), "m2": (1, "S1"), "m2r": (2, "S1,R"),
            "big": (1, "S1"), "bf": (1, "R"), "empty": (2, "S0,S1")}  # fmt: skip


def full(name: str) -> torch.Tensor:
    shape, dtype, _, _ = SAVED[name]
    n = torch.tensor(shape).prod().item()
    return (torch.arange(n, dtype=torch.float64) * 0.5 + len(name)).reshape(shape).to(dtype)


PLAIN_W = torch.arange(30.0).reshape(5, 6)  # saved as a plain tensor by every rank


def whole_target() -> dict[str, Any]:
    """A target of plain tensors of the global shapes (one process restoring a sharded checkpoint)."""
    target: dict[str, Any] = {k: torch.zeros(s, dtype=dt) for k, (s, dt, _, _) in SAVED.items()}
    return target | {"p": torch.zeros(2), "rank": -1, "w": torch.zeros(5, 6)}


def _placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in spec.split(",")]


def _meshes(world: int) -> dict[int, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    two = (2, world // 2) if world > 1 else (1, 1)
    return {1: init_device_mesh("cpu", (world,)), 2: init_device_mesh("cpu", two)}


def dstate(world: int, layout: dict[str, tuple[int, str]], fill: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    meshes = _meshes(world)
    return {k: distribute_tensor(fill(k), meshes[m], _placements(p)) for k, (m, p) in layout.items()}


def hierarchy(d: Path, rank: int, world: int) -> Hierarchy:
    eng = make_engine("threads", 2)
    tier = PfsTier("pfs", d, eng, job="sharded-test")
    tier.compress = CompressConfig("none")  # plain copies: the tests flip and count their raw bytes
    return Hierarchy([tier], rank=rank, world_size=world, job="sharded-test")


# -- the ranks' bodies (module level: spawned processes import them) -------------------------------------
def _save(rank: int, world: int, d: Path) -> tuple[dict[str, Any], list[float]]:
    """Step 1: the DTensors of SAVED; step 2: an FSDP2 model and AdamW (:func:`_fsdp_save`). One job
    saves both: each spawned job costs seconds of process-group and mesh setup."""
    packing.CHUNK_BYTES = CHUNK
    state: dict[str, Any] = dstate(world, {k: (m, p) for k, (_, _, m, p) in SAVED.items()}, full)
    state |= {"p": torch.full((2,), float(rank)), "rank": rank, "w": PLAIN_W}
    with hierarchy(d, rank, world) as h:
        h.save(state, step=1, blocking=True)
    return _fsdp_save(rank, world, d)


def _restore(rank: int, world: int, d: Path) -> dict[str, Any]:
    """Restore into other placements on ``world`` ranks; return what differs from the saved values (ranks
    beyond the saved ones list the step by its commit record: they saved no copy of it)."""
    target: dict[str, Any] = dstate(world, RESTORED, lambda k: torch.zeros(SAVED[k][0], dtype=SAVED[k][1]))
    target |= {"p": torch.zeros(2), "rank": -1, "w": dstate(world, {"w": (1, "S1")}, lambda k: torch.zeros(5, 6))["w"]}
    with hierarchy(d, rank, world) as h:
        h.restore(1, into=target)
    bad = {k: "differs" for k in SAVED if not torch.equal(target[k].full_tensor(), full(k))}
    if not torch.equal(target["w"].full_tensor(), PLAIN_W):  # a plain tensor saved, a DTensor restored
        bad["w"] = "differs"
    return bad | {"p": target["p"].tolist(), "rank": target["rank"]}


def _same_layout(rank: int, world: int, d: Path) -> list[int]:
    """Restore into the saved layout; return the ranks whose copies were opened."""
    opened: list[int] = []
    real = PfsTier.open_copy

    def spy(self: PfsTier, key: CheckpointKey) -> Any:
        opened.append(key.rank)
        return real(self, key)

    PfsTier.open_copy = spy  # type: ignore[method-assign]  # this process only
    target = dstate(
        world, {k: (m, p) for k, (_, _, m, p) in SAVED.items()}, lambda k: torch.zeros(SAVED[k][0], dtype=SAVED[k][1])
    )
    with hierarchy(d, rank, world) as h:
        h.restore(1, into=target, strict=False)
    assert all(torch.equal(target[k].full_tensor(), full(k)) for k in SAVED)
    return sorted(set(opened))


def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], args: tuple[Any, ...], q: Any) -> None:
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        try:
            q.put((rank, fn(rank, world, *args), None))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, None, traceback.format_exc()))


def spawn(world: int, fn: Callable[..., Any], *args: Any, store: Path, timeout: float = 60) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; each rank's result."""
    # forkserver: a fork of a server that has imported torch (fast), never of this process, whose other
    # tests' threads may hold locks a forked child would wait on forever
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", "torch.distributed.fsdp", "tierckpt", __name__])
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, str(store), fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, res, err = q.get(timeout=timeout)
            if err is not None:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            out[rank] = res
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} did not answer in {timeout} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[float]]:
    """The 4-rank job's directory, and of its FSDP2 model (step 2) the whole values saved and the
    losses of 2 more steps."""
    d = tmp_path_factory.mktemp("sharded") / "pfs"
    (values, losses), *_ = spawn(4, _save, d, store=d.parent / "store-save")
    return d, values, losses


@pytest.fixture
def saved(saved_job: tuple[Path, dict[str, Any], list[float]]) -> Path:
    return saved_job[0]


def manifests(d: Path) -> list[Any]:
    return [decode_manifest((d / "step-000000000001" / f"rank-{r:05d}" / "manifest").read_bytes()) for r in range(4)]


# -- tests -----------------------------------------------------------------------------------------------------
def test_each_shard_is_written_once_with_its_sharding(saved: Path) -> None:
    ms = manifests(saved)
    for r, m in enumerate(ms):
        t = m.tensors
        row = {p: i for i, p in enumerate(t.paths)}
        assert m.version == 5 and m.world_size == 4 and m.chunk_bytes == CHUNK
        assert [x.shape for x in m.meshes] == [(4,), (2, 2)] and m.meshes[0].ranks == (0, 1, 2, 3)
        # replicated shards: stored by the replica at 0 on every Replicate dim, the others keep the reference
        assert (t.lengths[row["state['rep']"]] > 0) == (r == 0)
        assert (t.lengths[row["state['m2r']"]] > 0) == (r in (0, 1))  # mesh (2, 2): rows 0 and 1 store
        assert t.shapes[row["state['s0']"]] == ((3, 6) if r < 3 else (1, 6))
        assert t.shapes[row["state['empty']"]] == ((1, 2) if r < 3 else (0, 2))
        big = m.sharding[row["state['big']"]]
        assert len(big.chunks) == 4 and big.global_shape == (64, 256)
        assert "state['p']" in row and row["state['p']"] not in m.sharding
    on_disk = sum(f.stat().st_size for f in saved.glob("step-000000000001/rank-*/*.bin"))
    stored = sum(m.tensor_bytes for m in ms)
    unique = sum(full(k).nbytes for k in SAVED) + 4 * (
        8 + PLAIN_W.nbytes
    )  # each shard once; each rank its plain "p", "w"
    assert stored == unique and on_disk < 2 * unique + 4 * 4 * 4096


def test_restore_on_two_ranks_reshards_every_layout(saved: Path, tmp_path: Path) -> None:
    got = spawn(2, _restore, saved, store=tmp_path / "store")
    assert got == [{"p": [0.0, 0.0], "rank": 0}, {"p": [1.0, 1.0], "rank": 1}]


def test_restore_on_eight_ranks_takes_plain_values_of_rank_0_beyond_the_saved_ranks(
    saved: Path, tmp_path: Path
) -> None:
    got = spawn(8, _restore, saved, store=tmp_path / "store", timeout=90)  # ranks 4-7 saved no copy
    assert got == [{"p": [float(r if r < 4 else 0)] * 2, "rank": r if r < 4 else 0} for r in range(8)]


def test_restore_on_four_ranks_into_the_saved_layout_reads_own_copies(saved: Path, tmp_path: Path) -> None:
    got = spawn(4, _same_layout, saved, store=tmp_path / "store")
    # its own copy only: a replicated shard is read by the replica that stored it and sent to the others
    assert got == [[0], [1], [2], [3]]


# -- one process reading the 4-rank checkpoint ------------------------------------------------------------------
def reader(*dirs: Path, rank: int = 0) -> Hierarchy:
    eng = make_engine("threads", 2)
    tiers = [PfsTier(f"pfs{i}", d, eng, readonly=True) for i, d in enumerate(dirs)]
    return Hierarchy(tiers, readonly=True, rank=rank, world_size=4 if rank else 1)


def test_one_process_restores_whole_tensors_into_plain_targets(saved: Path) -> None:
    target = whole_target()
    with reader(saved) as h:
        h.restore(1, into=target)
    assert all(torch.equal(target[k], full(k)) for k in SAVED)
    assert target["p"].tolist() == [0.0, 0.0] and target["rank"] == 0


def test_restore_without_into_returns_the_boxes_the_rank_saved(saved: Path) -> None:
    with reader(saved, rank=3) as h:
        got = h.restore(1)
    assert torch.equal(got["s0"], full("s0")[9:]) and torch.equal(got["s1"], full("s1")[:, 6:])
    assert torch.equal(got["rep"], full("rep"))  # stored by rank 0 alone: read from its copy
    assert torch.equal(got["m2r"], full("m2r")[5:])  # coordinate (1, 1): rank 1 stored it
    assert got["empty"].shape == (0, 2) and got["rank"] == 3


def _opened(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    opened: list[int] = []
    real = PfsTier.open_copy
    monkeypatch.setattr(PfsTier, "open_copy", lambda self, key: opened.append(key.rank) or real(self, key))
    return opened


def test_a_box_is_read_from_the_copies_that_overlap_it_only(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.datapath.reshard import read_box

    tier = PfsTier("pfs", saved, make_engine("threads", 2), readonly=True)
    opened = _opened(monkeypatch)
    assert torch.equal(read_box(tier, CheckpointKey(1, 0), "state['s0']", (3, 6), (0, 0)), full("s0")[:3])
    assert opened == [0]
    opened.clear()
    assert torch.equal(read_box(tier, CheckpointKey(1, 0), "state['s0']", (2, 2), (2, 3)), full("s0")[2:4, 3:5])
    assert opened == [0, 1]
    opened.clear()
    assert torch.equal(read_box(tier, CheckpointKey(1, 2), "state['m2']", (6, 2), (0, 3)), full("m2")[:, 3:])
    assert sorted(opened) == [1, 2, 3]  # mesh (2, 2) S0,S1: columns 3-4 are ranks 1 and 3's


def _flip(d: Path, rank: int, path: str, byte: int) -> None:
    """Flip byte ``byte`` of tensor ``path`` in rank ``rank``'s blob."""
    rd = d / "step-000000000001" / f"rank-{rank:05d}"
    m = decode_manifest((rd / "manifest").read_bytes())
    i = m.tensors.paths.index(path)
    f, base = blob_file(rd, m.tensors.blobs[i])
    data = bytearray(f.read_bytes())
    data[base + m.tensors.offsets[i] + byte] ^= 0x40
    f.write_bytes(bytes(data))


def test_a_range_read_verifies_the_chunks_it_reads(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 stored rows 16-31 of ``big``, 4 rows (4 KiB) a chunk: a flipped byte in its chunk 2 (rows
    24-27) fails every read that uses those rows, and no read that does not."""
    import shutil

    from tierckpt import CorruptCheckpointError
    from tierckpt.datapath.reshard import read_box

    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    _flip(bad, 1, "state['big']", 2 * CHUNK + 100)
    tier = PfsTier("pfs", bad, make_engine("threads", 2), readonly=True)
    key = CheckpointKey(1, 0)
    assert torch.equal(read_box(tier, key, "state['big']", (8, 256), (16, 0)), full("big")[16:24])
    assert torch.equal(read_box(tier, key, "state['big']", (4, 10), (28, 5)), full("big")[28:32, 5:15])
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in bytes \[8192, 12288\)") as e:
        read_box(tier, key, "state['big']", (1, 1), (25, 255))  # a byte away from the flipped one
    assert e.value.key == "state['big']" and e.value.tier == "pfs"
    target = whole_target()
    with reader(bad) as h, pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        h.restore(1, into=target)
    with reader(bad, saved) as h:  # the damaged copy first: the restore falls back to the good one
        h.restore(1, into=target)
        assert h.last_restore == (1, "pfs1")
    assert all(torch.equal(target[k], full(k)) for k in SAVED)


# -- FSDP2 + AdamW through get_state_dict ------------------------------------------------------------------------
def _fsdp(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return fsdp_mlp(world, (8, 18, 5), 1e-2)  # 18, 5: uneven shards


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:  # the same batch on every rank
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(sd: dict[str, Any]) -> dict[str, Any]:
    """Whole values as lists (a tensor sent through a queue lives in the sender's shared memory)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist() for k, v in sd.items()}


def _fsdp_save(rank: int, world: int, d: Path) -> tuple[dict[str, Any], list[float]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp(world)
    _train(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    with hierarchy(d, rank, world) as h:
        h.save({"model": msd, "optim": osd, "step": 2}, step=2, blocking=True)
    saved = _full(msd) | {f"exp_avg/{k}": v["exp_avg"] for k, v in _full_state(osd).items()}
    return saved, _train(model, opt, range(2, 4))


def _full_state(osd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: _full(v) for k, v in osd["state"].items()}


def _fsdp_restore(rank: int, world: int, d: Path) -> tuple[dict[str, Any], list[float], int]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp(world)
    _train(model, opt, range(7, 8))  # a step of other data: the optimizer has state to restore into
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd, "step": 0}
    with hierarchy(d, rank, world) as h:
        h.restore(2, into=target)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    got = _full(msd) | {f"exp_avg/{k}": v["exp_avg"] for k, v in _full_state(osd).items()}
    return got, _train(model, opt, range(2, 4)), target["step"]


def test_fsdp2_and_adamw_state_restores_on_two_ranks_and_training_goes_on(
    saved_job: tuple[Path, dict[str, Any], list[float]], tmp_path: Path
) -> None:
    d, values, losses = saved_job
    for got, after, step in spawn(2, _fsdp_restore, d, store=tmp_path / "store"):
        assert step == 2 and sorted(got) == sorted(values)
        for k, v in values.items():
            assert got[k] == v, k  # bit-exact
        assert after == pytest.approx(losses, rel=1e-5)  # 2 ranks reduce in another order than 4


def test_fsdp2_state_restores_in_one_process_into_a_plain_model(
    saved_job: tuple[Path, dict[str, Any], list[float]],
) -> None:
    """No process group: the plain model's tensors receive the whole global tensors."""
    d, values, losses = saved_job
    model, opt = _fsdp(0)
    _train(model, opt, range(7, 8))
    osd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]  # get_state_dict keys the optimizer state by name
    target = {"model": model.state_dict(), "optim": {"state": {names[i]: v for i, v in osd["state"].items()},
              "param_groups": [dict(g, params=names) for g in osd["param_groups"]]}, "step": 0}  # fmt: skip
    with reader(d) as h:
        h.restore(2, into=target)
    for k, v in model.state_dict().items():
        assert v.tolist() == values[k], k
    assert _train(model, opt, range(2, 4)) == pytest.approx(losses, rel=1e-5)


def test_the_other_ranks_copies_come_from_the_next_tier_that_holds_them(saved: Path, tmp_path: Path) -> None:
    """A node-local tier holds only its node's ranks' copies: this rank's is read there, the shards of the
    others come from the next tier that holds their copies; with no such tier the restore says which rank."""
    import shutil

    from tierckpt.errors import TierIOError

    node = tmp_path / "node"
    shutil.copytree(saved / "step-000000000001" / "rank-00000", node / "step-000000000001" / "rank-00000")
    shutil.copyfile(saved / "step-000000000001" / "commit", node / "step-000000000001" / "commit")  # its record
    target = whole_target()
    with reader(node) as h, pytest.raises(TierIOError, match=r"no tier \('pfs0'\) holds a copy of step 1 of rank 1"):
        h.restore(1, into=target)
    with reader(node, saved) as h:
        h.restore(1, into=target)
        assert h.last_restore == (1, "pfs0")
    assert all(torch.equal(target[k], full(k)) for k in SAVED)


def test_inspect_shows_the_sharding(saved: Path) -> None:
    from tierckpt.facade.describe import describe, text_lines

    m = manifests(saved)[2]
    info = describe(m, "pfs")
    assert info["meshes"] == [{"shape": [4], "ranks": [0, 1, 2, 3]}, {"shape": [2, 2], "ranks": [0, 1, 2, 3]}]
    by_key = {t["key"]: t for t in info["tensors"]}
    assert by_key["state['m2r']"]["sharding"] == {
        "global_shape": [9, 4],
        "mesh": 1,
        "placements": ["R", "S(0)"],
        "stored": False,
    }
    assert "sharding" not in by_key["state['p']"]
    text = "\n".join(text_lines(info))
    assert "state['m2r']  float32[5, 4]  0B  shard of [9, 4] [R, S(0)] on mesh 1, stored by another replica" in text
    assert "mesh 1: shape [2, 2], ranks [0, 1, 2, 3]" in text
