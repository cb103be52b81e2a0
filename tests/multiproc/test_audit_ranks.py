"""Audit findings 2, 5 and 6 (its restore side) on spawned gloo ranks (tests/multiproc/harness.py), each rank on a
simulated node (``$TIERCKPT_NODE``, ``{node}`` in the ssd path). Every test saves with one job, arranges
the files on disk as a killed job leaves them (the public API and file manipulation only), then restarts
the job (new processes, other world sizes) and checks what docs/distributed.md promises:

* finding 2: a copy the step's record does not name (rank 1's copy of step 2 replaced by its copy of
  step 1, as a re-save killed before its commit leaves it) is an unusable copy: every rank falls back to
  step 1. On 8c32cc0 rank 1 relists 50 times and raises CheckpointEvictedError, rank 0 times out: no
  rank restores, on every restart.
* finding 5: a resharded restore (2 ranks saved, 4 restore) whose newest step is on the node-local
  tiers only: no copy was evicted, so no rank relists; the ranks fall back to the older step pfs holds,
  or (none) fail at once naming the copy no tier holds. On 8c32cc0 three ranks relist 50 times (~9 s
  of sleeps alone) and raise CheckpointEvictedError.
* finding 6: a 2-rank restart after a killed 3-rank job fails on every rank although an older step is
  intact on pfs: (a) the ranks' listings differ (the kill fell between the two nodes' writes of the
  step's node-local record), a rank whose listing is newer reads the agreed step as a *given* step, and
  a resharded read it cannot do raises "step 125 is unusable on every tier … older committed steps:
  [122, 123, 124]" instead of falling back; (b) a rank falls back to a step another rank cannot read,
  and that rank raises on the agreed step (while the one that fell back returns it: the ranks diverge).
* ``restore(step=N)``, which is not negotiated, where one rank cannot read N: every rank raises (that rank
  its own error, the others a CoordinationError naming it). On 987543a the other ranks returned step N
  and the job hung at its next collective.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from harness import spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy
from tierckpt.testing.tamper import blob_file

TIMEOUT = 20.0  # the coordinator's; a rank that waits on one that raised fails within it


# -- the jobs (module level: run in the spawned ranks) -------------------------------------------------------
def config(root: str, tiers: list[str]) -> dict[str, Any]:
    kinds = {
        "ssd": {"name": "ssd", "kind": "local", "path": root + "/nodes/node{node}/ssd"},
        "pfs": {"name": "pfs", "kind": "pfs", "path": root + "/pfs"},
    }
    return {
        "tiers": [kinds[t] for t in tiers],
        "io": {"engine": "threads", "chunk": "1MiB"},
        "distributed": {"timeout": TIMEOUT},
    }


def plain(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(100 * step + rank)), "step": step}


def whole(step: int, rows: int) -> torch.Tensor:
    """The global tensor a sharded save of ``step`` holds (rows x 4)."""
    return torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000.0 * step


def sharded(rank: int, world: int, step: int, rows: int) -> dict[str, Any]:
    """``whole(step)`` as a DTensor sharded Shard(0) over this job's ranks (rows divisible by ``world``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.chunk(whole(step, rows), world)[rank].clone()
    return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False), "step": step}


def start(rank: int, spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    os.environ["TIERCKPT_NODE"] = str(spec["nodes"][rank])
    os.environ["TIERCKPT_JOB"] = spec["job"]


def save_job(rank: int, world: int, spec: dict[str, Any]) -> list[int]:
    """Save ``spec["steps"]`` (blocking), plain or sharded; this rank's listing at the end."""
    start(rank, spec)
    with Hierarchy.from_config(config(spec["root"], spec["tiers"])) as h:
        for step in spec["steps"]:
            st = sharded(rank, world, step, spec["rows"]) if spec.get("rows") else plain(rank, step)
            h.save(st, step=step, blocking=True).wait()
        return [c.step for c in h.checkpoints()]


def restore_job(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Restore ``spec.get("step")`` (None: without a step; plain: fresh tensors; sharded: into a DTensor
    sharded for this job), then save ``spec.get("then")``; what this rank got (or its error), how long
    the restore took."""
    start(rank, spec)
    out: dict[str, Any] = {}
    with Hierarchy.from_config(config(spec["root"], spec["tiers"])) as h:
        out["listed"] = [c.step for c in h.checkpoints()]
        target = sharded(rank, world, 0, spec["rows"]) if spec.get("rows") else {}
        if target:
            target["w"].to_local().zero_()
            target["step"] = -1
        t0 = time.monotonic()
        try:
            if target:
                h.restore(spec.get("step"), into=target)
                step = target["step"]
                good = torch.equal(target["w"].to_local(), torch.chunk(whole(step, spec["rows"]), world)[rank])
            else:
                got = h.restore(spec.get("step"))
                step = got["step"]
                good = torch.equal(got["w"], plain(rank, step)["w"])
            out |= {"restored": step, "good": good}
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["secs"] = time.monotonic() - t0
        if "error" not in out and spec.get("then"):
            h.save(plain(rank, spec["then"]), step=spec["then"], blocking=True).wait()
            out["after"] = [c.step for c in h.checkpoints()]
    return out


def run(fn: Any, world: int, tmp: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    got = spawn(fn, world, tmp, spec, limit=180)
    for r, res in enumerate(got):
        assert res is not None and "ok" in res, f"rank {r}: {res}"
    return [res["ok"] for res in got]  # type: ignore[index]  # checked above


def step_dir(root: Path, tier: str, step: int, node: int | None = None) -> Path:
    base = root / "pfs" if tier == "pfs" else root / "nodes" / f"node{node}" / "ssd"
    return base / f"step-{step:012d}"


def outcomes(ranks: list[dict[str, Any]]) -> list[Any]:
    """Per rank: (step restored, bytes right) or its error."""
    return [(r["restored"], r["good"]) if "error" not in r else r["error"] for r in ranks]


def show(ranks: list[dict[str, Any]]) -> str:
    """Each rank's outcome in full, one a line (for failure messages)."""
    return "\n" + "\n".join(f"rank {i}: {r}" for i, r in enumerate(ranks))


# -- finding 2 -----------------------------------------------------------------------------------------------
def test_a_copy_the_record_does_not_name_makes_every_rank_fall_back(tmp_path: Path) -> None:
    root = tmp_path / "job"
    spec = {"root": str(root), "tiers": ["pfs"], "nodes": [0, 1], "job": "audit-2"}
    assert run(save_job, 2, tmp_path, spec | {"steps": [1, 2]}) == [[1, 2], [1, 2]]
    # rank 1's copy of step 2 is its copy of step 1: what a re-save killed between its copy and its record
    # leaves (any copy the record does not name); nothing is being saved or evicted any more
    shutil.rmtree(step_dir(root, "pfs", 2) / "rank-00001")
    shutil.copytree(step_dir(root, "pfs", 1) / "rank-00001", step_dir(root, "pfs", 2) / "rank-00001")
    for _ in range(2):  # every restart
        ranks = run(restore_job, 2, tmp_path, spec)
        assert outcomes(ranks) == [(1, True), (1, True)], show(ranks)


# -- finding 5 -----------------------------------------------------------------------------------------------
ROWS5 = 8  # 2 ranks saved 4 rows each; 4 ranks restore 2 rows each


def test_a_resharded_restore_whose_newest_step_is_on_other_nodes_only_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "job"
    spec = {"root": str(root), "tiers": ["ssd", "pfs"], "nodes": [0, 1], "job": "audit-5", "rows": ROWS5}
    assert run(save_job, 2, tmp_path, spec | {"steps": [24, 25]}) == [[24, 25], [24, 25]]
    shutil.rmtree(step_dir(root, "pfs", 25))  # step 25 only on the node-local tiers (its demotion never ran)
    ranks = run(restore_job, 4, tmp_path, spec | {"nodes": [0, 0, 1, 1]})
    # rank 0 can read step 25 (its box is in saved rank 0's copy, on its node); ranks 1-3 cannot: every
    # rank restores step 24, which every rank reads (from pfs where its node lacks a copy)
    assert outcomes(ranks) == [(24, True)] * 4, show(ranks)


def test_a_resharded_restore_of_copies_on_other_nodes_only_fails_at_once_naming_them(tmp_path: Path) -> None:
    root = tmp_path / "job"
    spec = {"root": str(root), "tiers": ["ssd", "pfs"], "nodes": [0, 1], "job": "audit-5b", "rows": ROWS5}
    assert run(save_job, 2, tmp_path, spec | {"steps": [25]}) == [[25], [25]]
    shutil.rmtree(step_dir(root, "pfs", 25))
    ranks = run(restore_job, 4, tmp_path, spec | {"nodes": [0, 0, 1, 1]})
    errors = [r.get("error", "") for r in ranks]
    assert all(errors), show(ranks)  # no rank can restore: some rank's part is on another node only
    assert not any("evicted or replaced" in e for e in errors), show(ranks)  # nothing was evicted
    assert any("holds a copy of step 25 of rank" in e for e in errors), show(ranks)  # the missing copy is named
    assert max(r["secs"] for r in ranks) < 8, show(ranks)  # no relisting (50 relists sleep ~9 s)


# -- finding 6 -----------------------------------------------------------------------------------------------
ROWS6 = 6  # 3 ranks saved 2 rows each; 2 ranks restore 3 rows each (rank 0's rows are saved ranks 0-1's)


def test_a_two_rank_restart_after_a_killed_three_rank_job_restores_the_older_intact_step(tmp_path: Path) -> None:
    """The 3-rank job ran on two nodes (rank 0 on node 0, ranks 1-2 on node 1) and was killed: pfs, whose
    demotion lags, holds steps up to 124; both nodes committed 125 on their ssd; for 126 every rank's copy
    was in and node 0 wrote its record, while ranks 1-2 were killed before writing node 1's
    (each rank writes its node's record once it learns the commit's outcome: policies/protocol.py
    ``committed_actions``, carried out by background/executor.py). The 2-rank
    restart (rank 0 on node 0, rank 1 on node 1): rank 0 lists 126, rank 1 only 125, they agree on 125;
    rank 0 cannot read 125 (saved rank 1's rows are on node 1 only) and, reading 125 as a given step,
    raises instead of falling back; rank 1 raises quoting it. Step 124 is intact for both."""
    root = tmp_path / "job"
    spec = {"root": str(root), "tiers": ["ssd", "pfs"], "nodes": [0, 1, 1], "job": "audit-6", "rows": ROWS6}
    steps = [122, 123, 124, 125, 126]
    assert run(save_job, 3, tmp_path, spec | {"steps": steps}) == [steps] * 3
    for step in (125, 126):
        shutil.rmtree(step_dir(root, "pfs", step))
    (step_dir(root, "ssd", 126, node=1) / "commit").unlink()
    ranks = run(restore_job, 2, tmp_path, spec | {"nodes": [0, 1]})
    assert [r["listed"] for r in ranks] == [steps, steps[:-1]], show(ranks)  # the listings differ
    assert outcomes(ranks) == [(124, True), (124, True)], show(ranks)


def test_a_rank_that_cannot_read_the_step_another_fell_back_to_makes_the_job_go_further_back(tmp_path: Path) -> None:
    """2 ranks, pfs: rank 1's copy of step 3 and rank 0's copy of step 2 are damaged (one flipped byte each);
    step 1 is intact. Rank 0 reads 3, rank 1 falls back to 2; they agree on 2, which rank 0 reads as a
    given step and cannot: it raises, while rank 1 returns step 2 (the ranks diverge). The newest step
    every rank reads is 1."""
    root = tmp_path / "job"
    spec = {"root": str(root), "tiers": ["pfs"], "nodes": [0, 1], "job": "audit-6b"}
    assert run(save_job, 2, tmp_path, spec | {"steps": [1, 2, 3]}) == [[1, 2, 3]] * 2
    for step, rank in ((3, 1), (2, 0)):
        blob, base = blob_file(step_dir(root, "pfs", step) / f"rank-{rank:05d}")
        with open(blob, "r+b") as f:
            f.seek(base)
            b = f.read(1)
            f.seek(base)
            f.write(bytes([b[0] ^ 0xFF]))
    ranks = run(restore_job, 2, tmp_path, spec)
    assert outcomes(ranks) == [(1, True), (1, True)], show(ranks)


# -- restore(step=N) -------------------------------------------------------------------------------------------
def test_a_given_step_one_rank_cannot_read_makes_every_rank_raise(tmp_path: Path) -> None:
    """3 ranks, pfs: rank 1's copy of step 2 is its copy of step 1 (the record does not name it), and
    ``restore(step=2)`` is not negotiated. The ranks exchange their outcomes once: rank 1 raises its
    own error, ranks 0 and 2 a CoordinationError naming rank 1 and its error, and no rank returns a step."""
    root = tmp_path / "job"
    spec = {"root": str(root), "tiers": ["pfs"], "nodes": [0, 1, 2], "job": "audit-step"}
    assert run(save_job, 3, tmp_path, spec | {"steps": [1, 2]}) == [[1, 2]] * 3
    shutil.rmtree(step_dir(root, "pfs", 2) / "rank-00001")
    shutil.copytree(step_dir(root, "pfs", 1) / "rank-00001", step_dir(root, "pfs", 2) / "rank-00001")
    ranks = run(restore_job, 3, tmp_path, spec | {"step": 2, "then": 3})
    errors = [r.get("error", "") for r in ranks]
    assert "restored" not in str(ranks) and "after" not in str(ranks), show(ranks)  # no rank returned
    assert errors[1].startswith("CheckpointNotFoundError: ") and "rank 1's copy is not the one" in errors[1], show(
        ranks
    )
    for r in (0, 2):
        assert errors[r].startswith("CoordinationError: restore: rank(s) [1] could not restore step 2"), show(ranks)
        assert "rank 1: CheckpointNotFoundError" in errors[r], show(ranks)
    ranks = run(restore_job, 3, tmp_path, spec | {"step": 1})  # a step every rank reads: as before
    assert outcomes(ranks) == [(1, True)] * 3, show(ranks)
