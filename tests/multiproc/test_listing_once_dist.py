"""4 spawned gloo ranks on a tier whose listing is not cheap (a pfs directory declared an object store:
``cheap_listing=False``, its calls counted): rank 0 lists it once when the hierarchies open and
publishes what it saw through the job's store; no other rank lists it, and no rank lists it per save,
through saves, retention's evictions, a restore in a new job, a job killed in a commit and restarted.
A rank 0 that dies before it publishes fails the others, naming it, within the coordinator's bounded
wait (docs/distributed.md, "Tiers listed by one rank")."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from harness import spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy
from tierckpt.errors import CoordinationError
from tierckpt.io.engine import make_engine
from tierckpt.ranks.distributed import distributed_coordinator
from tierckpt.testing.faulty import FaultyTier
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.pfs import PfsTier

N = 4
TIMEOUT = 5.0
GRACE = min(5.0, 0.5 + TIMEOUT / 4)
JOB = "listing-once"
LISTINGS = ("list_committed", "list_records")


class ObjectStore(FaultyTier):
    """A pfs directory declared an object store (listing not cheap, shared), counting its calls; the
    process dies where ``die`` says: ``("write_record", step)`` or ``("list_committed", None)``."""

    def __init__(self, root: str, rank: int, die: tuple[str, int | None] | None = None) -> None:
        inner = PfsTier("obj", Path(root) / "obj", make_engine("threads", 2), job=JOB)
        super().__init__(inner, capabilities={"cheap_listing": False, "shared": True})
        self.die = die if rank == 0 else None

    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        if self.die == ("list_committed", None):
            os._exit(1)  # rank 0 dies listing the tier, before it publishes
        return super().list_committed(rank)

    def write_record(self, step: int, data: bytes) -> None:
        if self.die == ("write_record", step):
            os._exit(1)  # rank 0 dies in the commit: every copy durable, no record
        super().write_record(step, data)

    def counts(self) -> dict[str, int]:
        return {m: self.calls[m] for m in (*LISTINGS, "read_record", "holds")}


def state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(100 * step + rank)), "step": step}


def job(rank: int, world: int, root: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Open, restore (``spec["restore"]``), save ``spec["steps"]``, list, close: what this rank saw, and
    how often it asked the object store."""
    torch.set_num_threads(1)
    die = spec.get("die")
    obj = ObjectStore(root, rank, (die[0], die[1]) if die else None)
    coord = distributed_coordinator(timeout=TIMEOUT)
    out: dict[str, Any] = {}
    with Hierarchy([HostTier("host"), obj], job=JOB, coordinator=coord, policy={"keep": {"host": 1, "obj": 2}}) as h:
        out["open"] = obj.counts()
        if spec.get("restore"):
            got = h.restore()
            out["restored"] = [got["step"], torch.equal(got["w"], state(rank, got["step"])["w"])]
        for s in spec["steps"]:
            try:
                h.save(state(rank, s), step=s, blocking=True).wait()
            except CoordinationError as e:  # rank 0 died in this step's commit
                out["failed"] = [s, list(e.ranks), e.undecided]
                break
        out["listed"] = [c.step for c in h.checkpoints() if "obj" in c.tiers]
    return out | {"counts": obj.counts()}


def opens(rank: int, world: int, root: str) -> dict[str, Any]:
    """Open a hierarchy whose rank 0 dies listing the object store: how long the others waited."""
    torch.set_num_threads(1)
    obj = ObjectStore(root, rank, ("list_committed", None))
    start = time.monotonic()
    try:
        Hierarchy([obj], job=JOB, coordinator=distributed_coordinator(timeout=TIMEOUT)).close()
    except CoordinationError as e:
        return {"error": str(e), "ranks": list(e.ranks), "secs": time.monotonic() - start}
    return {"opened": True}


def run(fn: Any, tmp: Path, *args: Any) -> list[dict[str, Any] | None]:
    got = spawn(fn, N, tmp, *args, limit=180)
    return [r["ok"] if r is not None and "ok" in r else r for r in got]


def listings(got: list[Any], when: str = "counts") -> list[tuple[int, ...]]:
    return [tuple(g[when][m] for m in LISTINGS) for g in got]


def test_rank_0_lists_the_object_store_once_for_every_rank_across_saves_restarts_and_a_crash(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    # a job: open, 5 saves (3 evictions from obj), close
    first = run(job, tmp_path, root, {"steps": [1, 2, 3, 4, 5]})
    assert all(g is not None and "listed" in g for g in first), first
    assert listings(first, "open") == [(1, 1)] + [(0, 0)] * (N - 1)
    assert listings(first) == [(1, 1)] + [(0, 0)] * (N - 1)
    assert [g["counts"]["read_record"] for g in first[1:]] == [0] * (N - 1)
    assert [g["counts"]["holds"] for g in first] == [0] * N
    assert [g["listed"] for g in first] == [[4, 5]] * N

    # the next job: rank 0 dies in step 6's commit on obj, after every rank's copy is durable there
    crashed = run(job, tmp_path, root, {"restore": True, "steps": [6], "die": ["write_record", 6]})
    assert crashed[0] is None  # rank 0 died
    for g in crashed[1:]:
        assert g is not None and g["restored"] == [5, True], crashed
        assert g["failed"] == [6, [0], True]  # rank 0 arrived and published no outcome: unknown
        assert g["counts"]["list_committed"] == g["counts"]["list_records"] == 0
    step6 = Path(root) / "obj" / f"step-{6:012d}"
    assert sorted(p.name for p in step6.iterdir()) == [f"rank-{r:05d}" for r in range(N)]  # no record

    # restarted: every rank agrees on step 5, the newest committed; step 6's copies go as orphans
    again = run(job, tmp_path, root, {"restore": True, "steps": [7]})
    assert all(g is not None and "listed" in g for g in again), again
    assert [g["restored"] for g in again] == [[5, True]] * N
    assert listings(again) == [(1, 1)] + [(0, 0)] * (N - 1)
    assert [g["listed"] for g in again] == [[5, 7]] * N
    # a rank reads a record to check the copy it restores, and to judge its orphan: never to list
    assert [g["counts"]["read_record"] for g in again[1:]] == [2] * (N - 1)
    assert not step6.exists() or not list(step6.iterdir())


def test_a_rank_0_that_dies_before_publishing_fails_the_others_naming_it_in_bounded_time(tmp_path: Path) -> None:
    got = run(opens, tmp_path, str(tmp_path / "job"))
    assert got[0] is None  # rank 0 died listing
    for g in got[1:]:
        assert g is not None and g.get("ranks") == [0], got
        assert "tier 'obj': rank 0 lists it once for every rank" in g["error"] and "no listing came" in g["error"]
        assert g["secs"] < 2 * (TIMEOUT + GRACE) + 5  # the coordinator's bound: it claimed the key, then died
