"""StoreCoordinator driven with one thread per rank on an in-process HashStore: the protocol (gather,
decide, the foreground collectives), its failures (a rank missing, rank 0 missing, a decision that
raises, a value that cannot be sent), that a failed key never blocks a later one, and that the store
does not grow."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from tierckpt.errors import ConfigError, CoordinationError
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.ranks.distributed import StoreCoordinator


def run_ranks(n: int, body: Callable[[int], Any], *, timeout: float = 30.0) -> list[Any]:
    """``body(rank)`` on ``n`` threads; each rank's result, or the exception it raised."""
    out: list[Any] = [None] * n

    def one(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as e:  # handed to the test
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def coordinators(n: int, store: Any = None, **kw: Any) -> list[StoreCoordinator]:
    store = store if store is not None else dist.HashStore()
    got = run_ranks(n, lambda r: StoreCoordinator(store, r, n, **kw))
    for c in got:
        assert isinstance(c, StoreCoordinator), c
    return got


def test_64_ranks_agree_on_every_kind_of_call_and_leave_the_store_as_they_found_it() -> None:
    store = dist.HashStore()
    cs = coordinators(64, store, timeout=10)
    keys = store.num_keys()

    def body(r: int) -> Any:
        c = cs[r]
        return (
            c.gather("sum", r, sum),
            c.gather("order", [r, f"r{r}", bytes([r])], lambda vs: [v[0] for v in vs]),
            c.agree_step(100 + r if r != 7 else 50),
            c.agree_step(None if r == 63 else 5),
            c.broadcast({"from": r, "t": (1, 2)}, src=5),
            c.decide("decision", lambda: f"rank {c.rank} decided"),
            c.all_gather(r * r)[-1],
            c.barrier(),
            c.gather("sum", -r, sum),  # a key used again after its call succeeded
        )

    for got in run_ranks(64, body):
        assert got == (
            2016, list(range(64)), 50, None, {"from": 5, "t": [1, 2]}, "rank 0 decided", 63 * 63, None, -2016,
        )  # fmt: skip
    assert isinstance(cs[0], Coordinator)
    assert store.num_keys() == keys, "a successful call leaves nothing in the store"


def test_keyed_calls_from_two_threads_in_different_orders_on_different_ranks() -> None:
    cs = coordinators(4, timeout=10)
    tiers = {t: [f"commit/{t}/{s}/1" for s in range(6)] for t in ("ssd", "pfs")}

    def body(r: int) -> dict[str, Any]:
        # one worker per tier, each in step order; the ranks start them in different orders, so rank 0
        # reaches pfs/0 before ssd/0 and rank 1 the other way round (a call-order match would mix them)
        got: dict[str, Any] = {}

        def worker(keys: list[str]) -> None:
            for k in keys:
                got[k] = cs[r].gather(k, (r, k), lambda vs, k=k: [v[0] for v in vs if v[1] == k])

        order = ["ssd", "pfs"] if r % 2 else ["pfs", "ssd"]
        ts = [threading.Thread(target=worker, args=(tiers[t],)) for t in order]
        for t in ts:
            t.start()
            time.sleep(0.05)
        for t in ts:
            t.join(20)
        return got

    for got in run_ranks(4, body):
        assert got == {k: [0, 1, 2, 3] for ks in tiers.values() for k in ks}


def test_one_thread_per_key_in_a_random_order_per_rank() -> None:
    cs = coordinators(4, timeout=10)
    keys = [f"k{i}" for i in range(16)]

    def body(r: int) -> list[Any]:
        got: dict[str, Any] = {}
        mine = random.Random(r).sample(keys, len(keys))

        def one(k: str) -> None:
            got[k] = cs[r].gather(k, r, sum)

        ts = [threading.Thread(target=one, args=(k,)) for k in mine]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        return [got.get(k) for k in keys]

    assert run_ranks(4, body) == [[6] * 16] * 4


def test_a_missing_rank_fails_the_others_at_once_naming_it_and_a_later_key_works() -> None:
    cs = coordinators(4, timeout=0.5)
    gate = threading.Event()

    def body(r: int) -> Any:
        c = cs[r]
        t0 = time.monotonic()
        if r == 2:
            gate.wait(10)  # hung past the others' timeout
        else:
            with pytest.raises(CoordinationError) as e:
                c.gather("commit/pfs/7/1", r, sum)
            took = time.monotonic() - t0
            if r == 1:
                gate.set()
            assert e.value.ranks == (2,), e.value
            assert "commit/pfs/7/1" in str(e.value) and "rank(s) 2 did not arrive within" in str(e.value)
            assert took < 0.5 + 2.0, took  # rank 0's timeout, not each rank's own timeout after it
        if r == 2:  # back: the failed key fails at once; the next one works
            t1 = time.monotonic()
            with pytest.raises(CoordinationError) as late:
                c.gather("commit/pfs/7/1", r, sum)
            assert late.value.ranks == (2,) and time.monotonic() - t1 < 0.4
        return c.gather("commit/pfs/8/1", r, sum)

    assert run_ranks(4, body) == [6, 6, 6, 6]


def test_rank_0_missing_makes_the_others_time_out_naming_it_and_rank_0_then_runs_nothing() -> None:
    cs = coordinators(3, timeout=0.3)
    ran: list[int] = []
    done = threading.Barrier(3)

    def body(r: int) -> Any:
        if r != 0:
            t0 = time.monotonic()
            with pytest.raises(CoordinationError) as e:
                cs[r].gather("retain/pfs/3", r, lambda vs: ran.append(1))
            assert e.value.ranks == (0,) and "rank 0 did not answer within" in str(e.value)
            assert 0.3 <= time.monotonic() - t0 < 3
        done.wait(10)
        if r == 0:  # comes back after the others gave up: the key failed; its decision is not run
            with pytest.raises(CoordinationError) as e0:
                cs[0].gather("retain/pfs/3", r, lambda vs: ran.append(1))
            assert e0.value.ranks == (0,)
        return cs[r].agree_step(10 + r)

    assert run_ranks(3, body) == [10, 10, 10]
    assert ran == []


def test_a_decision_that_raises_or_a_value_that_cannot_be_sent_fails_every_rank_with_its_message() -> None:
    cs = coordinators(3, timeout=5)

    def body(r: int) -> list[str]:
        msgs = []
        for key, value, fn in (
            ("boom", r, lambda vs: 1 / 0),
            ("object", object() if r == 1 else r, sum),
            ("huge", b"x" * (2 << 20) if r == 2 else b"", len),
            ("own", object() if r == 0 else r, sum),
            ("result", r, lambda vs: {1, 2}),
        ):
            with pytest.raises(CoordinationError) as e:
                cs[r].gather(key, value, fn)
            msgs.append(f"{e.value.ranks} {e.value}")
        return msgs

    for msgs in run_ranks(3, body):
        assert "ZeroDivisionError" in msgs[0] and "rank 0's decision failed" in msgs[0]
        assert msgs[1].startswith("(1,)") and "not plain data" in msgs[1]
        assert msgs[2].startswith("(2,)") and "larger than the limit" in msgs[2]
        assert msgs[3].startswith("(0,)") and "not plain data" in msgs[3]
        assert "not plain data" in msgs[4]
    assert run_ranks(3, lambda r: cs[r].gather("after", r, sum)) == [3, 3, 3]


def test_the_store_does_not_grow_over_a_long_job_with_failures() -> None:
    store = dist.HashStore()
    cs = coordinators(3, store, timeout=0.2)
    for c in cs:
        c.linger = 0.5  # what is left of a failed key goes at rank 0's first call after that
    base = store.num_keys()

    def body(r: int) -> None:
        for i in range(100):
            cs[r].gather(f"save/{i}", i, sum)
            if i % 25 == 0 and r != 2:  # rank 2 misses a key now and then
                with pytest.raises(CoordinationError):
                    cs[r].gather(f"missed/{i}", i, sum)
        cs[r].barrier()

    run_ranks(3, body)
    assert store.num_keys() <= base + 7 * 4  # at most the entries of the failed keys of the last 0.5 s
    time.sleep(0.5)
    run_ranks(3, lambda r: cs[r].barrier())
    assert store.num_keys() == base


def test_coordinators_on_one_store_never_read_each_others_keys() -> None:
    store = dist.HashStore()
    first = coordinators(2, store, timeout=0.2)
    with pytest.raises(CoordinationError):  # rank 1 alone: a failure stays under this key
        first[1].gather("save/1", 1, sum)
    second = coordinators(2, store, timeout=5)  # a restarted job (or a second hierarchy)
    assert {c.generation for c in first} == {0} and {c.generation for c in second} == {1}
    assert run_ranks(2, lambda r: second[r].gather("save/1", r + 1, sum)) == [3, 3]


def test_node_identity_comes_from_the_ranks_own_overrides() -> None:
    store = dist.HashStore()
    cs = run_ranks(6, lambda r: StoreCoordinator(store, r, 6, timeout=5, node=r % 2))
    for c in cs:
        assert c.ranks_on_node() == [r for r in range(6) if r % 2 == c.node]
        assert c.local_rank == c.ranks_on_node().index(c.rank)
    with pytest.raises(ConfigError, match="node"):
        StoreCoordinator(store, 0, 1, node=-1)
    with pytest.raises(ConfigError, match="timeout"):
        StoreCoordinator(store, 0, 1, timeout=0)


def _store(kind: str, tmp_path: Any) -> Any:
    if kind == "file":
        return dist.FileStore(str(tmp_path / "store"), -1)
    if kind == "tcp":
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore("job", dist.HashStore())


@pytest.mark.parametrize("kind", ["file", "tcp", "prefix"])
def test_every_kind_of_store(kind: str, tmp_path: Any) -> None:
    store = _store(kind, tmp_path)
    cs = coordinators(3, store, timeout=0.5)

    def body(r: int) -> Any:
        got = [cs[r].gather("a", r, sum), cs[r].agree_step(5 - r)]
        if r != 1:
            with pytest.raises(CoordinationError) as e:
                cs[r].gather("missed", r, sum)
            got.append(e.value.ranks)
        return [*got, cs[r].decide("b", lambda: "ok", timeout=10)]  # rank 1 is there long before rank 0

    assert run_ranks(3, body) == [[3, 3, (1,), "ok"], [3, 3, "ok"], [3, 3, (1,), "ok"]]


def test_a_rank_that_builds_no_coordinator_fails_the_others_constructors() -> None:
    store = dist.HashStore()
    got = run_ranks(2, lambda r: StoreCoordinator(store, r, 3, timeout=0.3))  # rank 2 never builds one
    for e in got:
        assert isinstance(e, CoordinationError) and e.ranks == (2,), e
        assert "construction" in str(e) and "coordinator=SoloCoordinator()" in str(e)
