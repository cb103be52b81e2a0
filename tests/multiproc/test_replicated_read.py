"""A job restoring replicated DTensors reads each stored byte once and exchanges the pieces
(docs/distributed.md, "Reading replicated bytes once"): 4 spawned gloo ranks save tensors sharded on a
1-D mesh, then restore them replicated on 1-D and 2-D meshes; the blob reads of every rank are
recorded and attributed to the saved tensors."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc.harness import spawn
from tierckpt import Hierarchy
from tierckpt.format.manifest import decode_manifest
from tierckpt.io import make_engine
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.tiers.pfs import PfsTier

CHUNK = 4096  # small checksum chunks (and pieces): small tensors span many
WORLD = 4
# name -> (global shape, dtype, the mesh it is restored on (1: (4,), 2: (2, 2)), restored placements);
# every one is saved as Shard(0) on the 1-D mesh
LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype, int, str]] = {
    "rep": ((64, 256), torch.float32, 1, "R"),  # 4 pieces: one saved shard each
    "uneven": ((241, 200), torch.float32, 2, "R,S0"),  # 121 / 120 rows per tp rank, 2 pieces each
    "rr": ((97, 300), torch.float32, 2, "R,R"),  # replicated over both dims: 4 pieces, 2 exchanges
    "bf": ((130, 160), torch.bfloat16, 1, "R"),
    "small": ((3, 5), torch.float32, 1, "R"),  # under a piece: one rank reads it
    "plain": ((5, 6), torch.float32, 0, ""),  # a plain tensor: each rank its own (not exchanged)
}


def full(name: str, step: int = 1) -> torch.Tensor:
    shape, dtype, _, _ = LAYOUT[name]
    n = torch.tensor(shape).prod().item()
    return (torch.arange(n, dtype=torch.float64) * 0.25 - len(name) + 1000 * (step - 1)).reshape(shape).to(dtype)


def _state(rank: int, saving: int = 0) -> dict[str, Any]:
    """The state step ``saving`` saves, or (0) a target of zeros in the restoring layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    meshes = {1: init_device_mesh("cpu", (WORLD,)), 2: init_device_mesh("cpu", (2, WORLD // 2))}
    out: dict[str, Any] = {"step": 7 if saving else 0}
    for k, (shape, dtype, mesh, spec) in LAYOUT.items():
        value = full(k, saving) if saving else torch.zeros(shape, dtype=dtype)
        if not mesh:
            out[k] = value + rank if saving else value
        elif saving:
            out[k] = distribute_tensor(value, meshes[1], [Shard(0)])
        else:
            places = [Replicate() if p == "R" else Shard(int(p[1])) for p in spec.split(",")]
            out[k] = distribute_tensor(value, meshes[mesh], places)
    return out


def _save(rank: int, world: int, d: str) -> None:
    from tierckpt.datapath import packing

    packing.CHUNK_BYTES = CHUNK
    eng = make_engine("threads", 2)
    tier = PfsTier("pfs", Path(d), eng, job="replicas")
    tier.compress = CompressConfig("none")  # plain copies: the tests flip their raw bytes
    with Hierarchy([tier], job="replicas") as h:
        for step in (1, 2):
            h.save(_state(rank, saving=step), step=step, blocking=True)


def _hierarchy(*dirs: str) -> Hierarchy:
    from tierckpt.ranks.distributed import distributed_coordinator

    eng = make_engine("threads", 2)
    tiers = [PfsTier(f"pfs{i}", Path(d), eng, readonly=True) for i, d in enumerate(dirs)]
    return Hierarchy(tiers, readonly=True, coordinator=distributed_coordinator(timeout=20))


def _record_reads() -> dict[str, list[list[Any]]]:
    """Record what this process reads: each blob read (``blobs``: [saved rank, blob, offset, bytes]) and
    each verified range of a saved shard (``spans``: [key, saved rank, first byte, end])."""
    from tierckpt.datapath import replicas
    from tierckpt.datapath.shardread import Filler
    from tierckpt.tiers._fileread import FileReader

    replicas.MIN_PIECE_BYTES = CHUNK
    got: dict[str, list[list[Any]]] = {"blobs": [], "spans": []}
    read, submit = FileReader.read, Filler.submit

    def spy_read(self: FileReader, blob: int, offset: int, addr: int, nbytes: int) -> Any:
        got["blobs"].append([int(self.dir.name.rpartition("-")[2]), blob, offset, nbytes])
        return read(self, blob, offset, addr, nbytes)

    def spy_submit(self: Filler, p: Any) -> Any:
        got["spans"].append([p.copy.m.tensors.paths[p.row][7:-2], p.copy.rank, p.c0, p.c1])
        return submit(self, p)

    FileReader.read = spy_read  # type: ignore[method-assign]  # this process only
    Filler.submit = spy_submit  # type: ignore[method-assign]
    return got


def _differs(target: dict[str, Any], rank: int, step: int = 1) -> list[str]:
    """The names whose values this rank did not get back (each replica checks its own local shard)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bad = [] if target["step"] == 7 else ["step"]
    for k, (shape, _, mesh, _) in LAYOUT.items():
        v = target[k]
        if not mesh:
            bad += [] if torch.equal(v, full(k, step) + rank) else [k]
            continue
        sizes, offsets = compute_local_shape_and_global_offset(shape, v.device_mesh, v.placements)
        want = full(k, step)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        bad += [] if torch.equal(v.to_local(), want) else [k]
    return bad


def _restore(rank: int, world: int, d: str) -> dict[str, Any]:
    """Restore into the replicated layouts: what differs, and the blob reads."""
    reads = _record_reads()
    target = _state(rank)
    with _hierarchy(d) as h:
        h.restore(1, into=target)
    return {"bad": _differs(target, rank), "reads": reads}


def _restore_damaged(rank: int, world: int, bad: str, good: str, bad2: str) -> dict[str, Any]:
    """Restore from a tier whose copy rank 2 reads is damaged (every rank fails), then from that tier
    and a good one (rank 2 falls back to the good one while the others read the damaged tier), then
    the newest step from a tier where rank 2's piece of step 2 is damaged (rank 2 falls back to step 1,
    and so does every rank)."""
    _record_reads()
    target = _state(rank)
    start = time.monotonic()
    try:
        with _hierarchy(bad) as h:
            h.restore(1, into=target)
        first: dict[str, Any] = {"ok": True}
    except Exception as e:
        first = {"type": type(e).__name__, "error": str(e), "ranks": list(getattr(e, "ranks", ()))}
    first["secs"] = time.monotonic() - start
    target = _state(rank)
    with _hierarchy(bad, good) as h:
        h.restore(1, into=target)
        where = h.last_restore
    out = {"first": first, "bad": _differs(target, rank), "where": list(where or ())}
    target = _state(rank)
    with _hierarchy(bad2) as h:
        h.restore(into=target)
        out["older"] = [*_differs(target, rank), *(h.last_restore or ())]
    return out | {"mismatch": _mismatched(rank, good)}


def _mismatched(rank: int, d: str) -> dict[str, Any]:
    """Rank 1 restores ``rep`` sharded where the others restore it replicated: every rank refuses."""
    from torch.distributed.tensor import DTensor, Shard

    target = _state(rank)
    if rank == 1:
        rep = target["rep"]
        target["rep"] = DTensor.from_local(torch.zeros(16, 256), rep.device_mesh, [Shard(0)], run_check=False)
    try:
        with _hierarchy(d) as h:
            h.restore(1, into=target)
    except Exception as e:
        return {"type": type(e).__name__, "error": str(e), "ranks": list(getattr(e, "ranks", ()))}
    return {"ok": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("replicas")
    assert spawn(_save, WORLD, d, str(d / "pfs")) == [{"ok": None}] * WORLD
    return d / "pfs"


def _stored(d: Path) -> int:
    """Bytes of tensors in the saved copies."""
    ms = [decode_manifest((d / "step-000000000001" / f"rank-{r:05d}" / "manifest").read_bytes()) for r in range(WORLD)]
    return sum(m.tensor_bytes for m in ms)


def test_replicated_tensors_are_read_once_per_job_and_exchanged(saved: Path) -> None:
    got = spawn(_restore, WORLD, saved.parent, str(saved))
    assert [g and g.get("ok", g)["bad"] for g in got] == [[]] * WORLD  # bit-exact on every rank
    spans = [[s for s in g["ok"]["reads"]["spans"]] for g in got]  # type: ignore[index]
    for name, (_, _, mesh, _) in LAYOUT.items():
        mine = [sum(c1 - c0 for k, _, c0, c1 in s if k == name) for s in spans]
        stored = full(name).nbytes
        if not mesh:  # a plain tensor: each rank its own copy's, whole
            assert mine == [stored] * WORLD
            continue
        # every stored byte once, plus at most a checksum chunk at each end of each piece's ranges
        assert stored <= sum(mine) <= stored + 4 * 2 * CHUNK, (name, mine, stored)
    assert [sum(c1 - c0 for k, _, c0, c1 in s if k == "rep") for s in spans] == [full("rep").nbytes // WORLD] * WORLD
    assert sum(1 for s in spans if any(k == "small" for k, *_ in s)) == 1  # under a piece: one rank reads it
    blobs = sum(n for g in got for *_, n in g["ok"]["reads"]["blobs"])  # type: ignore[index]
    assert blobs < 1.5 * _stored(saved)  # all reads, widened to the alignment (every replica: > 3x)


def test_a_rank_whose_read_fails_fails_every_rank_naming_it(saved: Path, tmp_path: Path) -> None:
    """Rank 2 reads the third piece of ``rep`` (saved rank 2's shard): a flipped byte there fails its
    read; every other rank raises naming rank 2 at once (no collective entered, nobody waits out a
    timeout). With a good copy on a second tier, rank 2 reads that tier, the others the first."""
    bad, bad2 = tmp_path / "bad", tmp_path / "bad2"
    _damage(saved, bad, 1)
    _damage(saved, bad2, 2)
    got = spawn(_restore_damaged, WORLD, tmp_path, str(bad), str(saved), str(bad2))
    assert all(g and "ok" in g for g in got), got
    res = [g["ok"] for g in got]  # type: ignore[index]
    assert res[2]["first"]["type"] == "CorruptCheckpointError" and "state['rep']" in res[2]["first"]["error"]
    for r in (0, 1, 3):
        first = res[r]["first"]
        assert first["type"] == "CoordinationError" and first["ranks"] == [2], first
        assert "rank 2: CorruptCheckpointError" in first["error"] and "checksum mismatch" in first["error"]
    assert all(x["first"]["secs"] < 10 for x in res)  # the coordinator's timeout is 20 s
    assert [x["bad"] for x in res] == [[]] * WORLD
    assert [x["where"] for x in res] == [[1, "pfs0"], [1, "pfs0"], [1, "pfs1"], [1, "pfs0"]]
    assert [x["older"] for x in res] == [[1, "pfs0"]] * WORLD  # step 1's values on every rank
    want = "differ in their replicated DTensors: rank(s) 1 plan other exchanges than ranks 0, 2, 3 of their group"
    for x in res:
        assert x["mismatch"]["type"] == "CoordinationError" and want in x["mismatch"]["error"], x["mismatch"]
        assert x["mismatch"]["ranks"] == [1]


def _damage(saved: Path, to: Path, step: int) -> None:
    """A copy of ``saved`` where a byte of rank 2's ``rep`` (its second chunk) of ``step`` is flipped."""
    shutil.copytree(saved, to)
    rd = to / f"step-{step:012d}" / "rank-00002"
    m = decode_manifest((rd / "manifest").read_bytes())
    i = m.tensors.paths.index("state['rep']")
    b = m.tensors.blobs[i]
    blob, base = rd / m.blobs[b].name, 0
    if not blob.exists():  # the blobs of the copy in one data file, one after the other
        blob, base = rd / "data.bin", sum(x.size for x in m.blobs[:b])
    data = bytearray(blob.read_bytes())
    data[base + m.tensors.offsets[i] + CHUNK + 5] ^= 0x10
    blob.write_bytes(bytes(data))
