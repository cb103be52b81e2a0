"""Eviction leaves nothing of a step behind when several ranks share a tier directory (docs/distributed.md,
"The global commit, step by step"): the ranks of a node evict a step from their node-local tier in any
order, and a job restarted on another number of ranks evicts the copies of the saving ranks it does not
have. Ranks are threads agreeing through a StoreCoordinator on an in-process HashStore."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import Hierarchy
from tierckpt.io import make_engine
from tierckpt.ranks.distributed import StoreCoordinator
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier


def copies(d: Path) -> list[str]:
    """``step/rank`` of every copy under a tier directory."""
    return sorted(f"{p.parent.name[5:].lstrip('0')}/{p.name[5:].lstrip('0') or 0}" for p in d.glob("step-*/rank-*"))


def coordinators(run_ranks: Any, n: int, node: Any) -> list[StoreCoordinator]:
    store = dist.HashStore()
    return run_ranks(n, lambda r: StoreCoordinator(store, r, n, timeout=20, node=node(r)))


class LateLister(LocalTier):
    """A node-local tier that lists its records only once its peer has evicted step 1 (removed its record):
    the order in which this rank would find its own copy of step 1 unlisted."""

    def list_records(self) -> list[int]:
        got = super().list_records()
        deadline = time.monotonic() + 10
        while {1, 2} <= set(got) and time.monotonic() < deadline:
            time.sleep(0.01)
            got = super().list_records()
        return got


def test_the_ranks_of_a_node_evict_their_copies_whichever_removes_the_record_first(
    tmp_path: Path, run_ranks: Any
) -> None:
    eng = make_engine("threads", 2)
    cs = coordinators(run_ranks, 2, lambda r: 0)  # one node, one ssd directory

    def body(r: int) -> list[int]:
        ssd = (LateLister if r == 0 else LocalTier)("ssd", tmp_path / "ssd", eng, job="j")
        with Hierarchy([ssd], coordinator=cs[r], job="j", policy={"keep": {"ssd": 1}}) as h:
            for step in (1, 2, 3):
                h.save({"w": torch.full((8,), float(r)), "step": step}, step=step).wait()
            return [c.step for c in h.checkpoints()]

    assert run_ranks(2, body) == [[3], [3]]
    assert copies(tmp_path / "ssd") == ["3/0", "3/1"]  # rank 0's copies of steps 1 and 2 are gone too
    eng.close()


def test_a_job_of_fewer_ranks_evicts_the_copies_of_the_ranks_it_does_not_have(tmp_path: Path, run_ranks: Any) -> None:
    eng = make_engine("threads", 2)

    def tiers(node: int) -> list[Any]:
        return [
            LocalTier("ssd", tmp_path / f"node{node}", eng, job="j"),
            PfsTier("pfs", tmp_path / "pfs", eng, job="j"),
        ]

    def save(cs: list[StoreCoordinator], step: int, n: int) -> None:
        def body(r: int) -> None:
            policy = {"keep": {"ssd": 1, "pfs": 1}}
            with Hierarchy(tiers(cs[r].node), coordinator=cs[r], job="j", policy=policy) as h:
                h.save({"w": torch.full((8,), float(r)), "step": step}, step=step).wait()

        assert run_ranks(n, body) == [None] * n

    save(coordinators(run_ranks, 4, lambda r: r // 2), 1, 4)  # ranks 0-1 on node 0, 2-3 on node 1
    assert copies(tmp_path / "node1") == ["1/2", "1/3"]
    save(coordinators(run_ranks, 2, lambda r: r), 2, 2)  # restarted on 2 ranks, one a node
    assert copies(tmp_path / "pfs") == ["2/0", "2/1"]  # ranks 2-3's copies of step 1 too
    assert copies(tmp_path / "node0") == ["2/0"] and copies(tmp_path / "node1") == ["2/1"]
    assert sorted(p.name for p in tmp_path.glob("*/step-*")) == ["step-000000000002"] * 3
    # one process (no coordinator of several ranks): the shared tier's step of 2 ranks goes whole
    with Hierarchy([PfsTier("pfs", tmp_path / "pfs", eng, job="j")], job="j", policy={"keep": {"pfs": 1}}) as h:
        h.save({"w": torch.zeros(8), "step": 3}, step=3).wait()
    assert copies(tmp_path / "pfs") == ["3/0"]
    eng.close()


def test_a_smaller_job_removes_the_uncommitted_copies_of_the_ranks_beyond_it(tmp_path: Path, run_ranks: Any) -> None:
    """A 4-rank job (two simulated nodes) killed before step 2's records: every rank's copy, no record,
    on the node-local ssd and the pfs. A 2-rank job (one rank a node) restores step 1 and saves step 2
    again: the copies of ranks 2-3 go with its first retention pass (rank 0 on the pfs, the lowest rank
    of a node on its ssd), and step 2 is the new save's, whole. (Rank 1's old copy on node 0's ssd stays:
    rank 1 now runs on node 1, and a rank of this job may be writing there: docs/distributed.md.)"""
    eng = make_engine("threads", 2)

    def tiers(node: int) -> list[Any]:
        return [
            LocalTier("ssd", tmp_path / f"node{node}", eng, job="j"),
            PfsTier("pfs", tmp_path / "pfs", eng, job="j"),
        ]

    def job(n: int, node: Any, steps: list[int], restore: bool) -> list[Any]:
        cs = coordinators(run_ranks, n, node)

        def body(r: int) -> Any:
            with Hierarchy(tiers(cs[r].node), coordinator=cs[r], job="j") as h:
                got = h.restore()["step"] if restore else None
                for step in steps:
                    h.save({"w": torch.full((8,), float(10 * step + r)), "step": step}, step=step).wait()
                return got

        return run_ranks(n, body)

    job(4, lambda r: r // 2, [1, 2], restore=False)
    for d in ("node0", "node1", "pfs"):
        (tmp_path / d / "step-000000000002" / "commit").unlink()
    assert job(2, lambda r: r, [2], restore=True) == [1, 1]
    assert copies(tmp_path / "pfs") == ["1/0", "1/1", "1/2", "1/3", "2/0", "2/1"]
    assert copies(tmp_path / "node1") == ["1/2", "1/3", "2/1"]  # the 4-rank job's step 1 is committed
    assert copies(tmp_path / "node0") == ["1/0", "1/1", "2/0", "2/1"]
    eng.close()
