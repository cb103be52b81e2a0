"""``Hierarchy.delete(step)`` in a job of spawned gloo ranks (two simulated nodes, ``{node}`` in the ssd
path): every rank calls it, as it calls ``save``; the shared tier's record goes once (rank 0, before any
rank evicts its copy), each node's ssd loses its node's copies and record; afterwards no rank lists or
restores the step, a second delete is the same named error on every rank, and the step's number can be
saved again. A job of another number of ranks deleting a step removes the copies of the saving job's
ranks it does not have, on the shared tier."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from harness import spawn  # tests/multiproc/harness.py


def config(tmp: str) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "host", "kind": "host"},
            {"name": "ssd", "kind": "local", "path": tmp + "/node{node}/ssd"},
            {"name": "pfs", "kind": "pfs", "path": tmp + "/pfs"},
        ],
        "io": {"chunk": "1MiB"},
        "distributed": {"timeout": 20},
    }


def state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.arange(1000.0) + 100 * step + rank, "rank": rank, "step": step}


def job(rank: int, world: int, tmp: str, saved: list[int], deleted: int) -> dict[str, Any]:
    from tierckpt import Hierarchy

    os.environ["TIERCKPT_NODE"] = str(rank // 2)  # two ranks a node
    os.environ["TIERCKPT_JOB"] = f"delete-{world}"
    out: dict[str, Any] = {}
    with Hierarchy.from_config(config(tmp)) as h:
        for s in saved:
            h.save(state(rank, s), step=s, blocking=True)
        out["before"] = {c.step: list(c.tiers) for c in h.checkpoints()}
        h.delete(deleted)
        out["after"] = {c.step: list(c.tiers) for c in h.checkpoints()}
        got = h.restore()
        out["newest"] = [got["step"], got["rank"], torch.equal(got["w"], state(rank, got["step"])["w"])]
        for what, call in (("restore", lambda: h.restore(step=deleted)), ("again", lambda: h.delete(deleted))):
            try:
                call()
                out[what] = None
            except Exception as e:
                out[what] = f"{type(e).__name__}: {e}"
        h.save(state(rank, 10 + deleted), step=deleted, blocking=True)  # the number, saved again
        got = h.restore(step=deleted)
        out["resaved"] = torch.equal(got["w"], state(rank, 10 + deleted)["w"])
        h.delete(deleted)
    return out


def steps_in(path: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in path.glob("step-*"))


def test_every_rank_deletes_a_step_from_shared_and_node_local_tiers(tmp_path: Path) -> None:
    got = spawn(job, 4, tmp_path, str(tmp_path), [1, 2, 3], 3, limit=120)
    for rank, r in enumerate(got):
        assert r is not None and "ok" in r, (rank, r)
        out = r["ok"]
        assert out["before"] == {str(s): ["host", "ssd", "pfs"] for s in (1, 2, 3)}, rank
        assert out["after"] == {str(s): ["host", "ssd", "pfs"] for s in (1, 2)}, rank
        assert out["newest"] == [2, rank, True]
        assert out["restore"].startswith("CheckpointNotFoundError") and "committed steps: [1, 2]" in out["restore"]
        assert out["again"] == (
            "CheckpointNotFoundError: cannot delete step 3: it is not committed on any tier of any rank "
            "(committed steps: [1, 2])"
        )
        assert out["resaved"]
    ranks = {"pfs": [0, 1, 2, 3], "node0/ssd": [0, 1], "node1/ssd": [2, 3]}  # the copies each directory holds
    for where, held in ranks.items():
        d = tmp_path / where
        assert steps_in(d) == [1, 2], where
        assert sorted(p.name for p in (d / "step-000000000002").iterdir()) == ["commit"] + [
            f"rank-{r:05d}" for r in held
        ], where


def test_a_job_of_fewer_ranks_deletes_every_ranks_copy_on_the_shared_tier(tmp_path: Path) -> None:
    """Saved by 4 ranks on two nodes, deleted by a job of 2 ranks on node 0: pfs loses the step's record
    and all 4 copies (rank 0 decides the ranks no rank of the job owns), node 0's ssd its two; node 1's
    ssd, where no rank of the job runs, keeps its copies (as an eviction leaves them: docs/distributed.md)."""
    got = spawn(job, 4, tmp_path, str(tmp_path), [1, 2], 1, limit=120)
    assert all(r is not None and "ok" in r for r in got), got
    got = spawn(restarted, 2, tmp_path, str(tmp_path), limit=120)
    assert got == [{"ok": []}, {"ok": []}]
    assert steps_in(tmp_path / "pfs") == [] and steps_in(tmp_path / "node0" / "ssd") == []
    assert steps_in(tmp_path / "node1" / "ssd") == [2]


def restarted(rank: int, world: int, tmp: str) -> list[int]:
    from tierckpt import Hierarchy

    os.environ["TIERCKPT_NODE"] = "0"
    os.environ["TIERCKPT_JOB"] = "delete-2"
    with Hierarchy.from_config(config(tmp)) as h:
        h.delete(2)
        return [c.step for c in h.checkpoints()]
