"""``files: per_node`` with 2 and 4 spawned gloo ranks on one node (docs/distributed.md, "A per-node data
file"): a ``host`` tier on top, the save demoted by the background mover into a ``pfs`` tier whose node's
ranks share one data file a step. One node file per step; bit-exact restores on the saved world size and
resharded on another; eviction removes the node file with the step's last copy; ``verify`` and
``tierckpt inspect --json``; a rank that reaches the exchange late or never (bounded waits, an error
naming the tier, the step and the node); a rank SIGKILLed mid-write of its region (nothing half-written
listed, the earlier step intact)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.location import split_location
from tierckpt.format.manifest import decode_manifest
from tierckpt.ranks.coordinator import SoloCoordinator
from tierckpt.tiers.pfs import PfsTier

TIMEOUT = 4.0
ROWS, COLS = 12, 300


def config(tmp: str, keep: int = 3) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "host", "kind": "host"},
            {"name": "pfs", "kind": "pfs", "path": tmp + "/pfs", "options": {"files": "per_node"}},
        ],
        "policy": {"keep": {"pfs": keep}},
        "io": {"chunk": "1MiB"},
        "distributed": {"timeout": TIMEOUT},
    }


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step


def plain(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3000 + 517 * rank, generator=g)  # parts of different sizes a rank


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"s": distribute_tensor(full(step), mesh, [Shard(0)]), "mine": plain(rank, step), "rank": rank}


def _env() -> None:
    os.environ["TIERCKPT_NODE"] = "0"  # every rank on one node
    os.environ["TIERCKPT_JOB"] = "pernode-job"


def _wait(handle: Any) -> dict[str, str | None]:
    futures.wait(list(handle.durable.values()))
    return {n: None if f.exception() is None else f"{type(f.exception()).__name__}: {f.exception()}"
            for n, f in handle.durable.items()}  # fmt: skip


def save_job(rank: int, world: int, tmp: str, steps: list[int], late: dict[str, float]) -> dict[str, Any]:
    """Save ``steps``; ``late``: rank 1 reaches the exchange of step ``late["step"]`` ``late["secs"]``
    seconds late (past the timeout: it never comes in time)."""
    _env()
    if late and rank == 1:
        from tierckpt.background.executor import RankExecutor

        place = RankExecutor.place

        def late_place(self: Any, tier: Any, key: Any, blobs: Any, name: Any) -> Any:
            if key.step == late["step"]:
                time.sleep(late["secs"])
            return place(self, tier, key, blobs, name)

        RankExecutor.place = late_place  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    h = Hierarchy.from_config(config(tmp))
    try:
        for step in steps:
            out[str(step)] = _wait(h.save(_state(rank, world, step), step=step))
        out["listed"] = {str(c.step): list(c.tiers) for c in h.checkpoints()}
        out["verify"] = [[s, t, None if e is None else str(e)] for s, t, e in h.verify()]
    finally:
        _close(h)
    return out


def _close(h: Hierarchy) -> None:
    # a failed copy's error is raised again at close: each save's outcome is kept already
    with contextlib.suppress(Exception):
        h.close()


def restore_job(rank: int, world: int, tmp: str, saved_world: int) -> dict[str, Any]:
    """Restore the newest step into DTensors sharded for this world size: bit-exact rows, and this
    rank's own plain tensor where it was a rank of the saving job (else rank 0's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _env()
    mesh = init_device_mesh("cpu", (world,))
    with Hierarchy.from_config(config(tmp)) as h:
        target = {"s": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]), "mine": None, "rank": -1}
        step = h.checkpoints()[-1].step
        mine_rank = rank if rank < saved_world else 0
        target["mine"] = torch.zeros_like(plain(mine_rank, step))
        got = h.restore(into=target)
        want = distribute_tensor(full(step), mesh, [Shard(0)]).to_local()
        out = {
            "step": step,
            "rows": bool(torch.equal(got["s"].to_local(), want)),
            "mine": bool(torch.equal(got["mine"], plain(mine_rank, step))),
            "from": list(h.last_restore),
        }
        # the mover promotes each rank's own copy back to host, read from its region; every rank restores
        promoted = h.prefetch(step, to="host").result(timeout=60) if rank < saved_world else None
        again = h.restore(step)
        out["promoted"] = [promoted, list(h.last_restore), bool(torch.equal(again["mine"], plain(mine_rank, step)))]
        return out


def _steps(tmp: Path) -> dict[int, list[str]]:
    root = tmp / "pfs"
    return {int(d.name[5:]): sorted(os.listdir(d)) for d in sorted(root.glob("step-*"))}


def _node_files(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("node-")]


@pytest.mark.parametrize("world", [2, 4])
def test_one_node_file_a_step_restores_bit_exact_on_the_same_and_another_world(world: int, tmp_path: Path) -> None:
    got = spawn(save_job, world, tmp_path, str(tmp_path), [1, 2, 3, 4], {}, limit=120)
    for r, out in enumerate(got):
        assert out is not None and "ok" in out, (r, out)
        assert all(out["ok"][str(s)] == {"host": None, "pfs": None} for s in (1, 2, 3, 4)), (r, out)
        assert all(e is None for _, _, e in out["ok"]["verify"]), (r, out["ok"]["verify"])
    steps = _steps(tmp_path)
    assert sorted(steps) == [2, 3, 4]  # keep: 3; step 1 evicted: its node file with its last copy
    for step, names in steps.items():
        assert len(_node_files(names)) == 1, (step, names)  # one data file per step and node
        assert [n for n in names if not n.startswith("node-")] == ["commit", *(f"rank-{r:05d}" for r in range(world))]
        for r in range(world):
            assert os.listdir(tmp_path / "pfs" / f"step-{step:012d}" / f"rank-{r:05d}") == ["manifest"]
    for reading in (world, 6 - world):  # the same world size, and another (4 <-> 2)
        back = spawn(restore_job, reading, tmp_path, str(tmp_path), world, limit=120)
        for r, out in enumerate(back):
            assert out is not None and "ok" in out, (reading, r, out)
            assert out["ok"]["step"] == 4 and out["ok"]["rows"] and out["ok"]["mine"], (reading, r, out)
            assert out["ok"]["from"] == [4, "pfs"], (reading, r, out)
            if reading <= world:  # every rank has its own copy to promote
                assert out["ok"]["promoted"] == ["host", [4, "host"], True], (reading, r, out)


@pytest.fixture(scope="module")
def saved2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pernode2")
    got = spawn(save_job, 2, tmp, str(tmp), [1, 2], {}, limit=120)
    assert all(o is not None and "ok" in o for o in got), got
    return tmp


def _reader(tmp: Path, rank: int = 0) -> Hierarchy:
    return Hierarchy.from_config(config(str(tmp)), readonly=True, coordinator=SoloCoordinator(rank, 2, node=0))


def test_one_process_reads_every_rank_region_and_verifies(saved2: Path) -> None:
    with _reader(saved2) as h:
        got = h.restore(into={"s": torch.zeros(ROWS, COLS), "mine": torch.zeros_like(plain(0, 2)), "rank": -1})
        assert torch.equal(got["s"], full(2))  # rows of both ranks' regions of the node file
        assert torch.equal(got["mine"], plain(0, 2))
        assert [(s, t, e) for s, t, e in h.verify()] == [(1, "pfs", None)] * 2 + [(2, "pfs", None)] * 2


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierckpt", *args], capture_output=True, text=True, timeout=120)


def test_inspect_json_shows_the_layout_node_file_and_offset(saved2: Path) -> None:
    step = saved2 / "pfs" / "step-000000000002"
    (node,) = _node_files(os.listdir(step))
    offsets = []
    yaml = saved2 / "pfs.yaml"
    yaml.write_text(f"tiers:\n  - {{name: pfs, kind: pfs, path: {saved2 / 'pfs'}}}\n")
    for rank in (0, 1):
        run = _cli("inspect", str(yaml), "--rank", str(rank), "--json")
        assert run.returncode == 0, run.stderr
        files = json.loads(run.stdout)["files"]
        assert files["layout"] == "per_node" and files["node_file"] == node, files
        offsets.append(files["offset"])
    assert offsets[0] == 0 and offsets[1] > 0 and offsets[1] % 4096 == 0
    assert os.path.getsize(step / node) >= offsets[1]
    verify = _cli("verify", str(yaml), "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout + verify.stderr


def test_the_old_code_path_rejects_a_per_node_manifest_file(saved2: Path) -> None:
    raw = (saved2 / "pfs" / "step-000000000002" / "rank-00001" / "manifest").read_bytes()
    with pytest.raises(CorruptCheckpointError, match="header says"):
        decode_manifest(raw)  # what a reader before per-node files does with the whole file
    manifest, loc = split_location(raw)
    assert loc is not None and decode_manifest(manifest).rank == 1


def _copy_of(saved: Path, tmp: Path) -> Path:
    import shutil

    shutil.copytree(saved, tmp / "c", ignore=shutil.ignore_patterns(".tierckpt-lease"))
    return tmp / "c"


def test_a_damaged_location_block_is_corrupt_never_wrong_data(saved2: Path, tmp_path: Path) -> None:
    d = _copy_of(saved2, tmp_path)
    p = d / "pfs" / "step-000000000002" / "rank-00001" / "manifest"
    raw = bytearray(p.read_bytes())
    raw[-9] ^= 0x01  # the offset's top byte: the block's checksum no longer holds
    p.write_bytes(bytes(raw))
    with _reader(d, 1) as h:
        with pytest.raises(CorruptCheckpointError, match="location block: checksum mismatch"):
            h.restore(step=2)
        bad = [(s, t, e) for s, t, e in h.verify() if e is not None]
    assert [(s, t, type(e)) for s, t, e in bad] == [(2, "pfs", CorruptCheckpointError)]


def test_a_missing_node_file_is_corrupt(saved2: Path, tmp_path: Path) -> None:
    d = _copy_of(saved2, tmp_path)
    step = d / "pfs" / "step-000000000002"
    for n in _node_files(os.listdir(step)):
        os.unlink(step / n)
    with _reader(d) as h, pytest.raises(CorruptCheckpointError, match="node file .* is missing"):
        h.restore(step=2)


def test_a_truncated_node_file_is_corrupt(saved2: Path, tmp_path: Path) -> None:
    d = _copy_of(saved2, tmp_path)
    step = d / "pfs" / "step-000000000002"
    (node,) = _node_files(os.listdir(step))
    os.truncate(step / node, 4096)  # rank 1's region is past the end now
    with _reader(d, 1) as h, pytest.raises(CorruptCheckpointError, match="does not fit in it"):
        h.restore(step=2)


def test_a_rank_late_within_the_timeout_waits_and_one_never_coming_fails_its_node_boundedly(tmp_path: Path) -> None:
    got = spawn(save_job, 2, tmp_path, str(tmp_path), [1, 2, 3], {"step": 1, "secs": 1.0}, limit=120)
    assert all(o is not None and o["ok"]["1"] == {"host": None, "pfs": None} for o in got), got
    t0 = time.monotonic()
    (tmp_path / "x").mkdir()
    got = spawn(save_job, 2, tmp_path / "x", str(tmp_path / "x"), [1, 2], {"step": 1, "secs": TIMEOUT + 3}, limit=120)
    took = time.monotonic() - t0
    for r, out in enumerate(got):
        assert out is not None and "ok" in out, (r, out)
        err = out["ok"]["1"]["pfs"]
        assert err is not None and "CoordinationError" in err, (r, out)
        assert "tier 'pfs': step 1: node 0" in err or r == 1, (r, err)  # rank 0 names tier, step and node
        assert out["ok"]["1"]["host"] is None and out["ok"]["2"] == {"host": None, "pfs": None}, (r, out)
    assert "rank(s) 1 of the node did not arrive" in got[0]["ok"]["1"]["pfs"]  # type: ignore[index]
    assert "configure its tiers the same way" in got[0]["ok"]["1"]["pfs"]  # type: ignore[index]
    assert took < 60
    steps = _steps(tmp_path / "x")
    assert sorted(steps) == [2] and len(_node_files(steps[2])) == 1  # step 1 left nothing on pfs


def kill_job(rank: int, world: int, tmp: str, victim: int) -> dict[str, Any]:
    """Save steps 1 and 2; rank ``victim`` is SIGKILLed once one piece of its step-2 region is written."""
    import signal

    import tierckpt.tiers._nodefile as nodefile

    _env()
    if rank == victim:
        write = nodefile.NodeFileWriter.write

        def write_then_die(self: Any, blob: int, offset: int, addr: int, nbytes: int) -> Any:
            done = write(self, blob, offset, addr, nbytes)
            if self.key.step == 2:
                done.result()
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        nodefile.NodeFileWriter.write = write_then_die  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    h = Hierarchy.from_config(config(tmp))
    try:
        for step in (1, 2):
            out[str(step)] = _wait(h.save(_state(rank, world, step), step=step))
    finally:
        _close(h)
    return out


@pytest.mark.parametrize("victim", [1, 0])  # a rank of the node, and its first (the node file's creator)
def test_a_rank_killed_mid_write_leaves_nothing_listed_and_the_earlier_step_intact(victim: int, tmp_path: Path) -> None:
    got = spawn(kill_job, 2, tmp_path, str(tmp_path), victim, limit=120)
    assert got[victim] is None
    survivor = got[1 - victim]
    assert survivor is not None and "ok" in survivor, survivor
    assert survivor is not None and survivor["ok"]["1"] == {"host": None, "pfs": None}, survivor
    assert survivor["ok"]["2"]["pfs"] is not None, survivor  # its step-2 commit on pfs failed
    with _reader(tmp_path) as h:  # an evaluation process: what is listed, and what it reads
        assert [(c.step, list(c.tiers)) for c in h.checkpoints()] == [(1, ["pfs"])]
        got1 = h.restore(into={"s": torch.zeros(ROWS, COLS), "mine": torch.zeros_like(plain(0, 1)), "rank": -1})
        assert torch.equal(got1["s"], full(1))
        assert all(e is None for _, _, e in h.verify())
    left = _steps(tmp_path).get(2, [])
    assert not any(n.startswith("rank-") or n == "commit" for n in left), left  # nothing of step 2 listed
    PfsTier("pfs", tmp_path / "pfs", job="pernode-job").close()  # a writable open sweeps what dead processes left
    assert 2 not in _steps(tmp_path), _steps(tmp_path)  # the node file, its scratch, the directory
