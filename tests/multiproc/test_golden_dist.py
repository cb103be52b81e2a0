"""Many-rank golden fixtures (tests/golden/README.md): checkpoints written by 2 gloo ranks, read with the
current code on 1, 2 and 4 ranks.

``tests/golden/dist-vN`` holds one step of DTensors (Shard(0), Shard(1), Replicate, uneven and empty
shards, a 2-D mesh, 4 KiB checksum chunks) and per-rank plain tensors and values, committed on a
node-local ``ssd`` tier per simulated node and on a shared ``pfs`` tier; ``tests/golden/dcp-vN`` one
step written by ``dcp.save`` through ``tierckpt.dcp.HierarchyWriter``. ``tests/golden/dist_states.py``
rebuilds the values they hold. Each fixture is copied to ``tmp_path`` (the repository is never written)
and read: ``restore()``, ``restore(into=)`` a state sharded for the reading world size and plain whole
tensors, the newest step agreed, the listing of a writable and a read-only hierarchy, ``verify()``, and
``dcp.load`` through ``HierarchyReader``; a flipped byte in rank 1's copy is found.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # (a DTensor's first use imports it: once in the fork server, not per rank)
import torch.distributed.checkpoint as dcp  # preloaded by the fork server with this module
import torch.distributed.tensor  # the same

from tests.multiproc.harness import spawn
from tierckpt import CorruptCheckpointError, Hierarchy, SoloCoordinator
from tierckpt.dcp import HierarchyReader
from tierckpt.dcp._record import RECORD_FORMAT
from tierckpt.testing.tamper import blob_file

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))
import dist_states as ds  # noqa: E402  (tests/golden is not a package)
import make_dist_fixture as mdf  # noqa: E402


def _versions(kind: str) -> list[int]:
    """The format versions of the fixtures of ``kind`` (``dist``, ``dcp``) in tests/golden."""
    found = (re.fullmatch(rf"{kind}-v(\d+)", p.name) for p in GOLDEN.glob(f"{kind}-v*") if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)  # dist-v5-pernode: tests/multiproc/test_golden_pernode.py


VERSIONS = _versions("dist")
versions = pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"v{v}")
STEP = f"step-{ds.DIST_STEP:012d}"
#: how a reading job lays out each DTensor: (1: the 1-D mesh of its ranks, 2: a 2-D mesh), placements
RESTORED = {"s0": (1, ("S1",)), "s1": (1, ("S0",)), "rep": (1, ("S0",)), "big": (1, ("S0",)),
            "one": (1, ("R",)), "m2": (2, ("S0", "S1"))}  # fmt: skip
TIMEOUT = 10.0  # the readers' coordination timeout: a rank that fails makes the others fail within it
DCP_RESTORED = {"w": ("S1",), "v": ("S0",), "rep": ("R",)}


def _copy(kind: str, version: int, tmp_path: Path, name: str | None = None) -> Path:
    """A copy of the fixture ``kind`` of ``version`` (or the one called ``name``; the tests never write
    into the repository)."""
    name = name or f"{kind}-v{version}"
    return Path(shutil.copytree(GOLDEN / name, tmp_path / name))


def _current(kind: str, version: int) -> str:
    """The fixture the current writer writes byte for byte: ``dcp-vN-r2`` for DCP's entries of record
    format 2 (``dcp-vN``: format 1's, still read), ``kind-vN`` otherwise."""
    return f"dcp-v{version}-r{RECORD_FORMAT}" if kind == "dcp" and RECORD_FORMAT > 1 else f"{kind}-v{version}"


#: every DCP fixture read: each format version's, and those of later record formats (tests/golden/README.md)
DCP_FIXTURES = sorted(p.name for p in GOLDEN.glob("dcp-v*") if p.is_dir())


def _node(rank: int, world: int) -> int:
    """The simulated node of a reading rank: the first half of the ranks on node 0. On 2 ranks each rank is
    where it saved (rank ``r`` on node ``r``); on 4, rank 1's copy and rank 0's (the one ranks 2 and 3
    start from) are on another node's ``ssd`` than the ranks reading them."""
    return rank * 2 // world


def _base(rank: int) -> int:
    """The saved rank whose plain values and boxes a reading rank gets back: its own, else rank 0's."""
    return rank if rank < ds.SAVED_WORLD else 0


# -- comparing, bit for bit ------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def diff(got: Any, want: Any, path: str = "state") -> list[str]:
    """Where ``got`` is not ``want``: exact types (containers included), keys in order, tensor dtypes,
    shapes and bytes."""
    if type(got) is not type(want):
        return [f"{path}: got {type(got).__name__} {got!r}, want {type(want).__name__} {want!r}"]
    if isinstance(want, torch.Tensor):
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            return [f"{path}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"]
        return [] if _bytes(got) == _bytes(want) else [f"{path}: values differ: {got} != {want}"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{path}: keys {list(got)} != {list(want)}"]
        return [d for k in want for d in diff(got[k], want[k], f"{path}[{k!r}]")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in diff(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def gathered(state: Any) -> Any:
    """``state`` with every DTensor replaced by its whole tensor (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, dict):
        return {k: gathered(v) for k, v in state.items()}
    return state


def target_of(want: Any) -> Any:
    """A ``restore(into=)`` target shaped like ``want``: tensors of 0xA5 bytes, plain values None."""
    if isinstance(want, torch.Tensor):
        return (
            torch.full((want.numel() * want.element_size(),), 0xA5, dtype=torch.uint8)
            .view(want.dtype)
            .reshape(want.shape)
        )
    if isinstance(want, dict):
        return {k: target_of(v) for k, v in want.items()}
    if type(want) is list:
        return [target_of(v) for v in want]
    return None  # tuples and plain values are assigned


# -- what the fixtures hold, rebuilt -----------------------------------------------------------------------------
def fresh_part(rank: int) -> dict[str, Any]:
    """What ``restore()`` returns on a reading rank: the boxes and plain values of its base rank."""
    base = _base(rank)
    model = {name: ds.saved_box(name, spec, base) for name, spec in ds.DIST_TENSORS.items()}
    if base != 0:  # a replicated shard this rank did not store comes back all the same
        model["rep"] = ds.full("rep", ds.DIST_TENSORS["rep"])
    return {"model": model, **ds.dist_plain(base)}


def whole_state(rank: int) -> dict[str, Any]:
    """The saved state with whole tensors, and the plain values a reading rank gets."""
    model = {name: ds.full(name, spec) for name, spec in ds.DIST_TENSORS.items()}
    return {"model": model, **ds.dist_plain(_base(rank))}


def sharded_target(world: int) -> dict[str, Any]:
    """A target sharded for ``world`` ranks (DTensors of zeros in :data:`RESTORED`'s layouts)."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        1: init_device_mesh("cpu", (world,)),
        2: init_device_mesh("cpu", (2, world // 2) if world > 1 else (1, 1)),
    }
    layout = {name: (meshes[m], placements) for name, (m, placements) in RESTORED.items()}
    return {"model": ds.dtensors(layout, ds.DIST_TENSORS, zero=True), **target_of(ds.dist_plain(0))}


def dcp_target(world: int) -> dict[str, Any]:
    """A ``dcp.load`` target sharded for ``world`` ranks (1: whole plain tensors), values zeroed."""
    plain = {"step": 0, "note": "", "pair": (0, ""), "extra": torch.zeros(4)}
    if world == 1:
        return {"model": {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in ds.DCP_TENSORS.items()}, **plain}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    layout = {name: (mesh, placements) for name, placements in DCP_RESTORED.items()}
    return {"model": ds.dtensors(layout, ds.DCP_TENSORS, zero=True), **plain}


def dcp_whole() -> dict[str, Any]:
    return {"model": {n: ds.full(n, s) for n, s in ds.DCP_TENSORS.items()}, **ds.dcp_plain()}


def _open(root: Path, kind: str, node: int, **kw: Any) -> Hierarchy:
    return Hierarchy.from_config(mdf.config(root, kind, node, timeout=TIMEOUT), **kw)


def _local_ptrs(target: dict[str, Any]) -> list[int]:
    return [t.to_local().data_ptr() for t in target["model"].values()]


def _listing(h: Hierarchy) -> list[list[Any]]:
    return [[c.step, list(c.tiers)] for c in h.checkpoints()]


# -- the reading ranks (module level: the spawned processes import them) -----------------------------------------
def _attempt(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and no error, or None and the error it raised (so that a rank whose read fails still
    takes part in the collectives after it, and the test sees every rank's outcome)."""
    try:
        return fn(), []
    except Exception as e:
        return None, [f"{type(e).__name__}: {e}"]


def _read(h: Hierarchy, call: Callable[[], Any], check: Callable[[Any], list[str]]) -> tuple[list[str], Any]:
    """Restore with ``call``: what ``check`` finds wrong with the result (or the error), and the
    ``[step, tier]`` it was read from (None when it failed)."""
    got, err = _attempt(call)
    return (err, None) if err else (check(got), list(h.last_restore or ()))


def read_dist(rank: int, world: int, root: str, sharded: bool = True) -> dict[str, Any]:
    """Read the copied ``dist`` fixture on ``world`` ranks; what each check found (lists of problems),
    and where each restore read from. ``sharded``: also into DTensors (they need a process group, even
    of one rank)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"read_from": {}}
    with _open(Path(root), "dist", _node(rank, world), readonly=True) as ro:
        out["readonly_listing"] = _listing(ro)
    with _open(Path(root), "dist", _node(rank, world), job="golden-read") as h:
        out["listing"] = _listing(h)
        out["fresh"], out["read_from"]["fresh"] = _read(
            h, lambda: h.restore(ds.DIST_STEP), lambda got: diff(got, fresh_part(rank))
        )
        if sharded:
            target = sharded_target(world)
            before = _local_ptrs(target)
            err, out["read_from"]["into_sharded"] = _read(
                h, lambda: h.restore(ds.DIST_STEP, into=target), lambda got: [] if got is target else ["not the target"]
            )
            found = diff(gathered(target), whole_state(rank))  # a collective: every rank, failed or not
            out["into_sharded"] = err or found
            out["filled_in_place"] = _local_ptrs(target) == before
        whole = target_of(whole_state(rank))
        out["into_whole"], out["read_from"]["into_whole"] = _read(
            h, lambda: h.restore(ds.DIST_STEP, into=whole), lambda got: diff(got, whole_state(rank))
        )
        out["newest"], out["read_from"]["newest"] = _read(h, h.restore, lambda got: diff(got, fresh_part(rank)))
        out["verify"] = [[s, t, None if e is None else repr(e)] for s, t, e in h.verify()]
    return out


def read_dcp(rank: int, world: int, root: str) -> list[str]:
    """``dcp.load`` of the copied ``dcp`` fixture on ``world`` ranks; what differs."""
    torch.set_num_threads(1)
    with _open(Path(root), "dcp", _node(rank, world), readonly=True) as h:
        target = dcp_target(world)
        _, err = _attempt(lambda: dcp.load(target, storage_reader=HierarchyReader(h)))  # step=None: the newest
        return err or diff(gathered(target), dcp_whole())


def read_both(rank: int, world: int, dist_root: str, dcp_root: str) -> dict[str, Any]:
    """Both fixtures in one job (each spawned job costs seconds of process and mesh setup)."""
    return {"dist": read_dist(rank, world, dist_root), "dcp": read_dcp(rank, world, dcp_root)}


# -- the writing ranks, what a reading rank should find, one process as one rank, damage ------------------------
def write_both(rank: int, world: int, root: str) -> None:
    """Save both fixtures' steps under ``root`` as the fixture writer does (rank ``rank`` of 2)."""
    for kind in mdf.KINDS:
        mdf.save_fixture(rank, kind, Path(root, kind))


def expected(rank: int, world: int, sharded: bool = True) -> dict[str, Any]:
    """What :func:`read_dist` returns on a reading rank when all is well.

    Every rank lists the step on both tiers (its node's ``ssd`` holds the step's record) and reads it
    from its node's ``ssd`` where the copy it starts from is there (its own, or rank 0's beyond the
    saved ranks; the saving rank ``r`` was on node ``r``; another rank's copy comes from ``pfs``), else
    from ``pfs``. It verifies its own copies (on ``pfs``, and on its node's ``ssd`` if saved there); a
    process alone (one rank: no ranks to connect) verifies every saved rank's that its tiers hold."""
    listed = [[ds.DIST_STEP, ["ssd", "pfs"]]]
    tier = "ssd" if _node(rank, world) == _base(rank) else "pfs"
    reads = ["fresh", *(["into_sharded"] if sharded else []), "into_whole", "newest"]
    verified = (["ssd"] if _node(rank, world) == rank else []) + ["pfs"]
    sharded_results = {"into_sharded": [], "filled_in_place": True} if sharded else {}
    return {
        "read_from": {what: [ds.DIST_STEP, tier] for what in reads},
        "readonly_listing": listed,
        "listing": listed,
        "fresh": [],
        **sharded_results,
        "into_whole": [],
        "newest": [],
        "verify": [[ds.DIST_STEP, t, None] for t in verified] if rank < ds.SAVED_WORLD else [],
    } | (
        {"verify": [[ds.DIST_STEP, "ssd", None]] + [[ds.DIST_STEP, "pfs", None]] * ds.SAVED_WORLD} if world == 1 else {}
    )


def _as_rank(root: Path, rank: int, world: int, **kw: Any) -> Hierarchy:
    """A read-only hierarchy of one process as rank ``rank`` of ``world`` on node :func:`_node`."""
    node = _node(rank, world)
    return _open(root, "dist", node, readonly=True, coordinator=SoloCoordinator(rank, world, node=node), **kw)


def _align(root: Path, kind: str) -> int:
    with Hierarchy.from_config(
        mdf.config(root, kind, 0), readonly=True, coordinator=SoloCoordinator(0, 2, node=0)
    ) as h:
        return h.inspect()[1].align


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_row(rank_dir: Path, m: Any, key: str, at: int) -> None:
    """Flip byte ``at`` of row ``key`` of the copy in ``rank_dir`` (manifest ``m``)."""
    row = next(t for t in m.tensors if t.path == key)
    path, base = blob_file(rank_dir, row.blob)
    _flip(path, base + row.offset + at)


# -- tests -------------------------------------------------------------------------------------------------------
def test_there_are_many_rank_fixtures() -> None:
    assert VERSIONS, f"no many-rank golden fixtures in {GOLDEN} (tests/golden/README.md)"
    assert _versions("dcp") == VERSIONS, "every version has a dist-vN and a dcp-vN fixture"


@versions
def test_dist_fixture_is_what_it_claims(version: int) -> None:
    """Committed files only (no lease, no scratch), a record on each node's ``ssd`` and on ``pfs``; two
    ranks' manifests of the directory's version with the sharding the state asks for."""
    fixture = GOLDEN / f"dist-v{version}"
    names = sorted(str(p.relative_to(fixture)) for p in fixture.rglob("*") if p.is_file())
    want = [
        f"node{r}/ssd/{STEP}/{f}"
        for r in (0, 1)
        for f in ("commit", f"rank-{r:05d}/blob-00000.bin", f"rank-{r:05d}/manifest")
    ]
    want += [f"pfs/{STEP}/commit"] + [f"pfs/{STEP}/rank-{r:05d}/{f}" for r in (0, 1) for f in ("data.bin", "manifest")]
    assert names == sorted(want)
    for rank in (0, 1):
        with Hierarchy.from_config(
            mdf.config(fixture, "dist", rank), readonly=True, coordinator=SoloCoordinator(rank, 2, node=rank)
        ) as h:
            assert _listing(h) == [[ds.DIST_STEP, ["ssd", "pfs"]]]
            tier, m = h.inspect(ds.DIST_STEP)
        assert (tier, m.version, m.world_size, m.rank, m.chunk_bytes) == ("ssd", version, 2, rank, mdf.CHUNK)
        assert [mesh.shape for mesh in m.meshes] == [(2,), (2, 1)]
        rows = {t.path: (i, t) for i, t in enumerate(m.tensors)}
        big_i, _ = rows["state['model']['big']"]
        assert len(m.sharding[big_i].chunks) == 2  # 4608 bytes a rank: two 4 KiB chunks
        rep_i, rep = rows["state['model']['rep']"]
        assert (m.sharding[rep_i].stored, rep.length > 0) == (rank == 0, rank == 0)  # stored by rank 0 alone
        assert rows["state['model']['one']"][1].shape == ((1, 3) if rank == 0 else (0, 3))
        assert rows["state['rng']"][0] not in m.sharding  # a plain row: each rank its own


def test_the_current_writer_writes_the_newest_fixtures_byte_for_byte(tmp_path: Path) -> None:
    """The writer is deterministic, DCP's metadata included: saving the same states on 2 ranks again gives
    the bytes of the fixtures of the version it writes (an encoding change without a version bump fails
    here; the single-rank fixtures hold no DTensor, so they cannot catch one in the sharding fields)."""
    assert spawn(write_both, ds.SAVED_WORLD, tmp_path, str(tmp_path / "w")) == [{"ok": None}] * ds.SAVED_WORLD
    for kind in mdf.KINDS:
        now = tmp_path / "now" / kind
        written = sorted(str(p.relative_to(now)) for p in mdf.copy_fixture(kind, tmp_path / "w" / kind, now))
        version = int.from_bytes(next(now.rglob("manifest")).read_bytes()[8:10], "little")  # docs/format.md
        fixture = GOLDEN / _current(kind, version)
        assert fixture.is_dir(), f"the writer writes format version {version}: add {fixture} (tests/golden/README.md)"
        if _align(now, kind) != _align(fixture, kind):
            pytest.skip(f"this file system's block size gives another alignment than {fixture.name}'s")
        assert written == sorted(str(p.relative_to(fixture)) for p in fixture.rglob("*") if p.is_file())
        changed = [n for n in written if (now / n).read_bytes() != (fixture / n).read_bytes()]
        assert not changed, (
            f"the v{version} encoding changed ({', '.join(changed)} differ from {fixture}): bump FORMAT_VERSION, "
            f"keep reading v{version}, and add many-rank fixtures for the new version (tests/golden/README.md)"
        )


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_dcp_fixture_is_what_it_claims(name: str) -> None:
    """Each rank's part on ``pfs`` and the step's record; rank 0's part holds DCP's metadata, and the
    values DCP gave rank 1 (deduplicated: one rank's copy each) are in rank 1's part only."""
    fixture, step = GOLDEN / name, f"pfs/step-{ds.DCP_STEP:012d}"
    names = sorted(str(p.relative_to(fixture)) for p in fixture.rglob("*") if p.is_file())
    assert names == [f"{step}/commit"] + [f"{step}/rank-{r:05d}/{f}" for r in (0, 1) for f in ("data.bin", "manifest")]
    parts = []
    for rank in (0, 1):
        with Hierarchy.from_config(
            mdf.config(fixture, "dcp", rank), readonly=True, coordinator=SoloCoordinator(rank, 2, node=rank)
        ) as h:
            assert _listing(h) == [[ds.DCP_STEP, ["pfs"]]]
            parts.append(h.restore(ds.DCP_STEP))
    assert [("metadata" in p["__dcp__"], p["__dcp__"]["rank"]) for p in parts] == [(True, 0), (False, 1)]
    assert parts[0]["__dcp__"]["world_size"] == 2
    held = [{k for k in ds.dcp_plain() if k in p} for p in parts]
    assert held[0] | held[1] == set(ds.dcp_plain()) and not held[0] & held[1], held


@versions
def test_one_process_reads_the_2_rank_checkpoint(tmp_path: Path, version: int) -> None:
    """An evaluation process (no process group): rank 0's part, and whole tensors from both ranks'
    copies (rank 1's from ``pfs``: node 0's ``ssd`` lacks it)."""
    root = _copy("dist", version, tmp_path)
    assert read_dist(0, 1, str(root), sharded=False) == expected(0, 1, sharded=False)


@versions
def test_rank_1_restarting_on_its_node_reads_its_own_copy(tmp_path: Path, version: int) -> None:
    """Rank 1 of the same 2 ranks on the same nodes: its ``ssd`` holds its copy (``rep``, stored by rank
    0 alone, comes from rank 0's copy on ``pfs``): ``restore()`` reads it there, as ``restore(into=)``."""
    with _as_rank(_copy("dist", version, tmp_path), 1, 2) as h:
        assert diff(h.restore(ds.DIST_STEP), fresh_part(1)) == []
        assert h.last_restore == (ds.DIST_STEP, "ssd")


@versions
def test_a_rank_beyond_the_saved_ones_restores_rank_0s_part(tmp_path: Path, version: int) -> None:
    """Rank 2 of 4 (no copy of its own): ``restore()`` returns rank 0's part and ``restore(into=)``
    plain whole tensors fills them, from rank 0's copy on ``pfs`` (not on node 1's ``ssd``)."""
    rank = 2
    with _as_rank(_copy("dist", version, tmp_path), rank, 4) as h:
        assert [c.step for c in h.checkpoints()] == [ds.DIST_STEP]
        whole = target_of(whole_state(rank))
        got = {
            "fresh": _read(h, lambda: h.restore(ds.DIST_STEP), lambda got: diff(got, fresh_part(rank))),
            "into_whole": _read(
                h, lambda: h.restore(ds.DIST_STEP, into=whole), lambda got: diff(got, whole_state(rank))
            ),
        }
    assert got == {what: ([], [ds.DIST_STEP, "pfs"]) for what in ("fresh", "into_whole")}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note that no_dist is on
@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_one_process_loads_the_dcp_checkpoint_without_a_process_group(tmp_path: Path, name: str) -> None:
    root = _copy("dcp", 0, tmp_path, name)
    with _open(root, "dcp", 0, readonly=True) as h:
        target = dcp_target(1)
        dcp.load(target, storage_reader=HierarchyReader(h, step=ds.DCP_STEP), no_dist=True)
        assert diff(target, dcp_whole()) == []
        assert h.verify() == [(ds.DCP_STEP, "pfs", None)] * 2  # a process alone: both ranks' parts


@versions
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_read_both_fixtures(tmp_path: Path, world: int, version: int) -> None:
    """On ``world`` spawned gloo ranks: restore, restore(into=) sharded for them, listing, verify, dcp.load."""
    dist_root, dcp_root = _copy("dist", version, tmp_path), _copy("dcp", version, tmp_path)
    results = spawn(read_both, world, tmp_path, str(dist_root), str(dcp_root), limit=120)
    wrong: dict[str, Any] = {}
    for rank, res in enumerate(results):
        if res is None or "ok" not in res:
            wrong[f"rank {rank}"] = res
            continue
        got, want = {"dcp": res["ok"]["dcp"], **res["ok"]["dist"]}, {"dcp": [], **expected(rank, world)}
        wrong |= {f"rank {rank}: {k}": v for k, v in got.items() if v != want[k]}
    assert not wrong, f"what {world} ranks read differs from what the fixtures hold: {wrong}"


@versions
def test_a_flipped_byte_in_rank_1s_copy_is_found(tmp_path: Path, version: int) -> None:
    """Rank 1's ``s0`` shard damaged on ``pfs``, its ``big`` shard's second checksum chunk on node 1's
    ``ssd``: rank 1's verify names each; its restore and a whole restore in one process on node 0 (rank
    1's shards from ``pfs``) fail; rank 0's part and copies are intact."""
    root = _copy("dist", version, tmp_path)
    with _as_rank(root, 1, 2) as h:
        _, m = h.inspect(ds.DIST_STEP)
    _flip_row(root / "pfs" / STEP / "rank-00001", m, "state['model']['s0']", 5)
    _flip_row(root / "node1" / "ssd" / STEP / "rank-00001", m, "state['model']['big']", 4096 + 100)
    with _as_rank(root, 1, 2) as h:  # a process alone: every rank's copy its tiers hold (rank 0's on pfs too)
        (s1, t1, e1), (s2, t2, e0), (s3, t3, e2) = h.verify()
        assert (s1, t1, s2, t2, s3, t3) == (ds.DIST_STEP, "ssd", ds.DIST_STEP, "pfs", ds.DIST_STEP, "pfs")
        assert isinstance(e1, CorruptCheckpointError) and "['big']" in str(e1) and e1.rank == 1, e1
        assert isinstance(e2, CorruptCheckpointError) and "['s0']" in str(e2) and e2.rank == 1, e2
        assert e0 is None
        with pytest.raises(CorruptCheckpointError, match=r"(?s)tier 'ssd'.*\['big'\].*tier 'pfs'.*\['s0'\]"):
            h.restore(ds.DIST_STEP, into=target_of(whole_state(1)))
    with _as_rank(root, 0, 1) as h:
        with pytest.raises(CorruptCheckpointError, match=r"rank 1's copy.*\['s0'\]"):
            h.restore(ds.DIST_STEP, into=target_of(whole_state(0)))
        assert diff(h.restore(ds.DIST_STEP), fresh_part(0)) == []
        ssd, pfs0, (step, tier, err) = h.verify()  # rank 1's pfs copy too (issue 27, finding 7)
        assert [ssd, pfs0, (step, tier)] == [
            (ds.DIST_STEP, "ssd", None),
            (ds.DIST_STEP, "pfs", None),
            (ds.DIST_STEP, "pfs"),
        ]
        assert isinstance(err, CorruptCheckpointError) and err.rank == 1 and "['s0']" in str(err), err
