"""A tier whose listing is not cheap (an object store's), in a job of several ranks, is listed by one
rank when the hierarchies open, and that rank's listing is published to the others through the
coordinator: no other rank lists it, and no rank lists it per save (docs/distributed.md, "Tiers listed
by one rank"). Ranks as threads on an in-process store; tests/multiproc/test_listing_once_dist.py runs
the same on spawned gloo ranks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tierckpt import Hierarchy
from tierckpt.errors import CoordinationError, TierIOError
from tierckpt.io.engine import IOEngine, make_engine
from tierckpt.ranks.distributed import StoreCoordinator
from tierckpt.testing.faulty import FaultyTier
from tierckpt.tiers.base import Tier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

N = 4
LISTINGS = ("list_committed", "list_records")


def expensive(inner: Tier, *, shared: bool = True, **kw: Any) -> FaultyTier:
    """``inner``, its listing declared expensive (``cheap_listing=False``, as an object store's), its
    calls counted."""
    return FaultyTier(inner, capabilities={"cheap_listing": False, "shared": shared}, **kw)


def counts(tier: FaultyTier) -> dict[str, int]:
    return {m: tier.calls[m] for m in (*LISTINGS, "read_record", "holds")}


def state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(100 * step + rank)), "step": step}


@pytest.fixture
def make_coordinators(run_ranks: Any) -> Callable[..., list[StoreCoordinator]]:
    """``make_coordinators(n, timeout=…, nodes=…)``: one StoreCoordinator a rank (its node ``nodes(rank)``) on
    an in-process store."""

    def make(n: int, timeout: float = 20.0, nodes: Callable[[int], int] = lambda r: 0) -> list[StoreCoordinator]:
        store = dist.HashStore()
        return run_ranks(n, lambda r: StoreCoordinator(store, r, n, timeout=timeout, node=nodes(r)))

    return make


@pytest.fixture
def eng() -> Any:
    e = make_engine("threads", 2)
    yield e
    e.close()


def job(
    root: Path, eng: IOEngine, cs: list[StoreCoordinator], rank: int, *, steps: list[int], restore: bool = False
) -> dict[str, Any]:
    """Open, restore the newest step (``restore``), save ``steps``, list, close: what this rank saw and
    how often it asked the object tier."""
    obj = expensive(PfsTier("obj", root / "obj", eng, job="j"))
    policy = {"keep": {"host": 1, "obj": 2}}
    with Hierarchy([HostTier("host"), obj], coordinator=cs[rank], job="j", policy=policy) as h:
        after_open = counts(obj)
        got = h.restore() if restore else None
        for s in steps:
            h.save(state(rank, s), step=s, blocking=True).wait()
        listed = [c.step for c in h.checkpoints() if "obj" in c.tiers]
    return {
        "open": after_open,
        "counts": counts(obj),
        "listed": listed,
        "restored": None if got is None else (got["step"], torch.equal(got["w"], state(rank, got["step"])["w"])),
    }


def uncommitted(root: Path, eng: IOEngine, run_ranks: Any, cs: list[StoreCoordinator]) -> Path:
    """A 4-rank job saves steps 1-3 and dies in step 3's commit on obj, every copy durable, before rank 0
    writes the record: step 3's directory there."""
    run_ranks(N, lambda r: job(root, eng, cs, r, steps=[1, 2, 3]))
    step3 = root / "obj" / f"step-{3:012d}"
    (step3 / "commit").unlink()
    return step3


def listings(got: list[dict[str, Any]], when: str = "counts") -> list[tuple[int, ...]]:
    return [tuple(g[when][m] for m in LISTINGS) for g in got]


def test_rank_0_lists_once_for_every_rank_and_no_rank_lists_per_save(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    cs = make_coordinators(N)
    got = run_ranks(N, lambda r: job(tmp_path, eng, cs, r, steps=[1, 2, 3, 4, 5]))
    assert all(isinstance(g, dict) for g in got), got
    assert listings(got, "open") == [(1, 1)] + [(0, 0)] * (N - 1)  # at open, rank 0 only
    assert listings(got) == [(1, 1)] + [(0, 0)] * (N - 1)  # 5 saves, 3 evictions, a close: nothing more
    assert [g["listed"] for g in got] == [[4, 5]] * N
    assert [g["counts"]["read_record"] for g in got[1:]] == [0] * (N - 1)  # no record read as a listing
    assert [g["counts"]["holds"] for g in got] == [0] * N


def test_a_new_job_restores_the_newest_step_listed_by_rank_0(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    cs = make_coordinators(N)
    first = run_ranks(N, lambda r: job(tmp_path, eng, cs, r, steps=[1, 2, 3]))
    assert [g["listed"] for g in first] == [[2, 3]] * N, first
    cs = make_coordinators(N)
    got = run_ranks(N, lambda r: job(tmp_path, eng, cs, r, steps=[4], restore=True))
    assert [g["restored"] for g in got] == [(3, True)] * N, got
    assert listings(got) == [(1, 1)] + [(0, 0)] * (N - 1)
    assert [g["listed"] for g in got] == [[3, 4]] * N
    # the restore reads the step's record once on each rank, to check the copy it reads (not a listing)
    assert [g["counts"]["read_record"] for g in got[1:]] == [1] * (N - 1)


def test_a_job_restarted_after_a_save_that_never_committed_agrees_on_the_newest_committed_step(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    step3 = uncommitted(tmp_path, eng, run_ranks, make_coordinators(N))
    cs = make_coordinators(N)
    got = run_ranks(N, lambda r: job(tmp_path, eng, cs, r, steps=[4], restore=True))
    assert [g["restored"] for g in got] == [(2, True)] * N, got
    assert listings(got) == [(1, 1)] + [(0, 0)] * (N - 1)
    assert [g["listed"] for g in got] == [[2, 4]] * N
    assert not step3.exists()  # every rank's orphan went in the first retention pass, none listed it


def test_rank_0_that_cannot_list_fails_every_rank_naming_it(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    cs = make_coordinators(N, timeout=5)

    def open_rank(rank: int) -> None:
        fail = {"list_committed": TierIOError(5, "SlowDown: please reduce your request rate")} if rank == 0 else {}
        obj = expensive(PfsTier("obj", tmp_path / "obj", eng, job="j"), fail=fail)
        Hierarchy([obj], coordinator=cs[rank], job="j").close()

    got = run_ranks(N, open_rank)
    assert isinstance(got[0], TierIOError) and "SlowDown" in str(got[0])
    for e in got[1:]:
        assert isinstance(e, CoordinationError) and e.ranks == (0,), e
        assert "tier 'obj': rank 0 lists it once for every rank" in str(e) and "SlowDown" in str(e)


def test_rank_0_that_never_publishes_fails_the_others_within_the_bounded_wait(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    timeout = 1.0
    cs = make_coordinators(N, timeout=timeout)
    hung, lock = threading.Event(), threading.Lock()
    done: list[int] = []  # the ranks other than 0 that returned

    def open_rank(rank: int) -> str:
        gates = {"list_committed": hung} if rank == 0 else {}
        obj = expensive(PfsTier("obj", tmp_path / "obj", eng, job="j"), gates=gates)
        if rank == 0:
            with contextlib.suppress(CoordinationError):  # the others gave up on it
                Hierarchy([obj], coordinator=cs[rank], job="j").close()
            return "rank 0 came back"
        try:
            Hierarchy([obj], coordinator=cs[rank], job="j").close()
        finally:
            with lock:
                done.append(rank)
                if len(done) == N - 1:
                    hung.set()  # rank 0 comes back once the others gave up
        return "opened"

    got = run_ranks(N, open_rank, timeout=30)
    assert got[0] == "rank 0 came back"
    for e in got[1:]:
        assert isinstance(e, CoordinationError) and e.ranks == (0,), e
        assert "tier 'obj'" in str(e) and "no listing came" in str(e) and "rank 0" in str(e)


def test_a_node_local_tier_is_listed_by_the_first_rank_of_each_node(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    cs = make_coordinators(N, nodes=lambda r: r // 2)

    def run(rank: int) -> dict[str, Any]:
        node = cs[rank].node
        ssd = expensive(LocalTier("ssd", tmp_path / f"node{node}", eng, job="j"), shared=False)
        with Hierarchy([HostTier("host"), ssd], coordinator=cs[rank], job="j", policy={"keep": {"ssd": 2}}) as h:
            for s in (1, 2, 3):
                h.save(state(rank, s), step=s, blocking=True).wait()
            return {"counts": counts(ssd), "listed": [c.step for c in h.checkpoints() if "ssd" in c.tiers]}

    got = run_ranks(N, run)
    assert all(isinstance(g, dict) for g in got), got
    assert listings(got) == [(1, 1), (0, 0), (1, 1), (0, 0)]  # ranks 0 and 2: their node's first
    assert [g["listed"] for g in got] == [[2, 3]] * N


def test_a_smaller_job_removes_the_strays_of_a_larger_one_from_rank_0s_listing_at_open(
    tmp_path: Path, eng: IOEngine, run_ranks: Any, make_coordinators: Any
) -> None:
    step3 = uncommitted(tmp_path, eng, run_ranks, make_coordinators(N))
    two = make_coordinators(2)
    got = run_ranks(2, lambda r: job(tmp_path, eng, two, r, steps=[4], restore=True))
    assert [g["restored"] for g in got] == [(2, True)] * 2, got
    assert listings(got) == [(1, 1), (0, 0)]
    assert not step3.exists()  # ranks 2-3's copies: strays rank 0 saw at open; ranks 0-1's: orphans
