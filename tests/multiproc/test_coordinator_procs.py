"""StoreCoordinator across spawned processes with gloo on CPU, as torchrun runs them: the parent holds
the job's TCPStore (torchrun's agent does), each rank joins it and initializes a gloo process group.
Hierarchies built in such a job pick the store coordinator by default, share rank 0's job identity
and fill their tier paths' ``{rank}`` / ``{node}``; a rank that dies or hangs makes the others fail
that call naming it, within the timeout, and the next call works once it is back."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import spawn  # tests/multiproc/harness.py

from tierckpt.errors import CoordinationError


# -- what the ranks run ------------------------------------------------------------------------------------
def agree(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from tierckpt import Hierarchy
    from tierckpt.ranks.distributed import StoreCoordinator

    os.environ["TIERCKPT_NODE"] = str(rank // 2)  # two ranks per simulated node
    config = {
        "tiers": [
            {"name": "host", "kind": "host"},
            {"name": "ssd", "kind": "local", "path": tmp + "/node{node}/ssd"},
            {"name": "pfs", "kind": "pfs", "path": tmp + "/pfs/{{shared}}"},
        ],
        "distributed": {"timeout": 20},
        # a cadence that reads the clock: rank 0 plans each save; pfs keeps 1: rank 0 decides its evictions
        "policy": {"demote": {"ssd": {"every_secs": 3600}}, "keep": {"pfs": 1}},
    }
    with Hierarchy.from_config(config) as h:
        c = h.coordinator
        assert isinstance(c, StoreCoordinator), c
        keyed: dict[str, Any] = {}

        def worker(tier: str) -> None:
            for step in range(4):
                key = f"commit/{tier}/{step}"
                keyed[key] = c.gather(key, [rank, step], lambda vs: sum(v[0] for v in vs))

        threads = [threading.Thread(target=worker, args=(t,)) for t in (["ssd", "pfs"][:: 1 if rank % 2 else -1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for step in (2, 3):
            h.save({"w": torch.full((4,), float(rank)), "rank": rank, "step": step}, step=step).wait()
        state = h.restore()
        return {
            "job": h.job,
            "gather": c.gather("g", {"r": rank}, lambda vs: [v["r"] for v in vs]),
            "decide": c.decide("d", lambda: f"by {rank}"),
            "agree": c.agree_step(10 - rank),
            "bcast": c.broadcast(rank * 10, src=world_size - 1),
            "keyed": keyed,
            "node": c.node,
            "on_node": c.ranks_on_node(),
            "local_rank": c.local_rank,
            "ssd": str(h.tier("ssd").location()),
            "pfs": str(h.tier("pfs").location()),
            "restored": [state["step"], state["rank"], state["w"].tolist()],
            "pfs_steps": sorted(c.step for c in h.checkpoints() if "pfs" in c.tiers),
        }


def die_or_fail(rank: int, world_size: int) -> list[Any]:
    from tierckpt.ranks.distributed import distributed_coordinator

    c = distributed_coordinator(timeout=1.5)
    got: list[Any] = []
    for key, dies in (("commit/ssd/5/1", 2), ("commit/ssd/6/1", 0)):
        if rank == dies:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            c.gather(key, rank, sum)
            got.append("ok")
        except CoordinationError as e:
            got.append([list(e.ranks), str(e), time.monotonic() - t0])
    return got


def hang(rank: int, world_size: int) -> list[Any]:
    from tierckpt.ranks.distributed import distributed_coordinator

    c = distributed_coordinator(timeout=1.0)
    got: list[Any] = []
    if rank == 2:
        time.sleep(2.5)  # hung past the others' timeout
    t0 = time.monotonic()
    try:
        c.gather("commit/pfs/9/1", rank, sum)
    except CoordinationError as e:
        got.append([list(e.ranks), str(e), time.monotonic() - t0])
    got.append(c.gather("commit/pfs/10/1", rank, sum, timeout=20))  # the next save works once it is back
    return got


# -- the tests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_spawned_ranks_agree_share_the_job_and_fill_rank_and_node(world_size: int, tmp_path: Path) -> None:
    got = spawn(agree, world_size, tmp_path, str(tmp_path))
    for r, g in enumerate(got):
        assert g is not None and "ok" in g, f"rank {r}: {g}"
    oks = [g["ok"] for g in got if g is not None]
    assert len({o["job"] for o in oks}) == 1, "every rank leases its tiers for rank 0's job identity"
    for r, o in enumerate(oks):
        assert o["gather"] == list(range(world_size))
        assert o["decide"] == "by 0"
        assert o["agree"] == 11 - world_size
        assert o["bcast"] == (world_size - 1) * 10
        assert o["keyed"] == {
            f"commit/{t}/{s}": world_size * (world_size - 1) // 2 for t in ("ssd", "pfs") for s in range(4)
        }
        assert (o["node"], o["on_node"], o["local_rank"]) == (r // 2, [r // 2 * 2, r // 2 * 2 + 1], r % 2)
        assert o["ssd"] == str(tmp_path / f"node{r // 2}" / "ssd")
        assert o["pfs"] == str(tmp_path / "pfs" / "{shared}")
        assert o["restored"] == [3, r, [float(r)] * 4]
        assert o["pfs_steps"] == [3]


def test_a_dead_rank_fails_the_others_within_the_timeout_naming_it(tmp_path: Path) -> None:
    got = spawn(die_or_fail, 3, tmp_path)
    assert got[2] is None and got[0] is None, got  # killed: rank 2 at the first key, rank 0 at the second
    assert got[1] and "ok" in got[1], got
    first, second = got[1]["ok"]  # type: ignore[index]
    assert first[0] == [2] and "rank(s) 2 did not arrive within" in first[1] and first[2] < 1.5 + 3
    assert second[0] == [0] and "rank 0 did not answer within" in second[1] and second[2] < 1.5 + 3


def test_a_hung_rank_fails_that_call_naming_it_and_the_next_call_works(tmp_path: Path) -> None:
    got = spawn(hang, 3, tmp_path)
    assert all(g and "ok" in g for g in got), got
    for r in (0, 1):
        (ranks, msg, took), total = got[r]["ok"]  # type: ignore[index]
        assert ranks == [2] and "'commit/pfs/9/1'" in msg and took < 1.0 + 1.5
        assert total == 3
    (ranks, msg, took), total = got[2]["ok"]  # type: ignore[index]
    assert ranks == [2] and took < 0.5, "the late rank gets the failure at once"
    assert total == 3
