"""Bandwidth budgets at work (docs/tiers.md, "Bandwidth budgets"): a demotion to a budgeted tier takes at
least the time its budget implies; a prefetch, a blocking save and a restore are not paced unless the
budget paces everything (the bucket's counters say which bytes it paced); an ``on_close`` flush and a kind
of one's own are paced too; a job of two ranks still commits on a budgeted shared tier."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy, register_tier
from tierckpt.io.budget import Budget, BudgetStats

MiB = 1 << 20
RATE = 16 * 10**6  # bytes per second: 8 MiB take about half a second
CHUNK = 1 * MiB  # the tiers' chunk, and so their buckets' burst
STATE = {"w": torch.arange(2 * MiB, dtype=torch.float32), "step": 1}  # 8 MiB


def chain(tmp_path: Path, budget: dict[str, Any], **policy: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "host", "kind": "host", "capacity": "64MiB"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd"), "io": budget},
        ],
        "io": {"chunk": "1MiB"},
        "policy": policy,
    }


def blob_bytes(h: Hierarchy, step: int) -> int:
    return sum(b.size for b in h.inspect(step)[1].blobs)


def stats(h: Hierarchy, tier: str = "ssd") -> BudgetStats:
    budget = h.tier(tier).budget
    assert isinstance(budget, Budget)
    return budget.stats()


def least_secs(nbytes: int) -> float:
    """What the budget implies: all but the one chunk a full bucket lets go at once, at the rate."""
    return (nbytes - CHUNK) / RATE


def test_a_demotion_takes_at_least_what_the_budget_implies(tmp_path: Path) -> None:
    with Hierarchy.from_config(chain(tmp_path, {"bandwidth": RATE})) as h:
        start = time.monotonic()
        handle = h.save(STATE, step=1)
        handle.durable["ssd"].result()
        took = time.monotonic() - start
        nbytes = blob_bytes(h, 1)
        assert stats(h).charged_bytes == nbytes and stats(h).unthrottled_bytes == 0
        assert took >= least_secs(nbytes)
        assert stats(h).waited_secs >= least_secs(nbytes) - 0.05  # the worker waited for it, not the disk


def test_prefetch_blocking_saves_and_restores_are_not_paced_by_default(tmp_path: Path) -> None:
    d = {"tiers": [{"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd"), "io": {"bandwidth": RATE}}]}
    d["io"] = {"chunk": "1MiB"}
    with Hierarchy.from_config(d) as h:  # the budgeted tier on top: the save packs straight into it
        h.save(STATE, step=1, blocking=True)
        nbytes = blob_bytes(h, 1)
        assert stats(h) == BudgetStats(0, 0.0, nbytes)
        h.save(STATE, step=2).wait()  # a non-blocking save is background work
        assert stats(h).charged_bytes == nbytes and stats(h).unthrottled_bytes == nbytes
    with Hierarchy.from_config(chain(tmp_path, {"bandwidth": RATE})) as h:  # a new process: host is empty
        assert h.prefetch(step=2).result() == "host"
        assert stats(h) == BudgetStats(0, 0.0, nbytes)
        assert torch.equal(h.restore(step=1)["w"], STATE["w"])  # from ssd, the one tier holding it
        assert h.last_restore == (1, "ssd")
        assert stats(h) == BudgetStats(0, 0.0, 2 * nbytes)


def test_throttle_all_paces_the_prefetch_too(tmp_path: Path) -> None:
    with Hierarchy.from_config(chain(tmp_path, {"bandwidth": RATE})) as h:
        h.save(STATE, step=1).wait()
        nbytes = blob_bytes(h, 1)
    with Hierarchy.from_config(chain(tmp_path, {"bandwidth": RATE, "throttle": "all"})) as h:
        start = time.monotonic()
        h.prefetch().result()
        assert time.monotonic() - start >= least_secs(nbytes)
        assert stats(h).charged_bytes == nbytes and stats(h).unthrottled_bytes == 0


def test_the_on_close_flush_is_paced(tmp_path: Path) -> None:
    small = {"w": torch.ones(MiB // 2), "step": 1}  # 2 MiB
    cfg = chain(tmp_path, {"bandwidth": RATE}, demote={"ssd": {"on_close": True}})
    with Hierarchy.from_config(cfg) as h:
        h.save(small, step=1).wait()
        assert h.checkpoints()[0].tiers == ("host",)
        assert stats(h) == BudgetStats()
        h.flush()
        nbytes = blob_bytes(h, 1)
        assert h.checkpoints()[0].tiers == ("host", "ssd")
        assert stats(h).charged_bytes == nbytes and stats(h).unthrottled_bytes == 0


def test_a_kind_of_ones_own_takes_a_budget_from_its_entry(tmp_path: Path) -> None:
    """The example object-store tier, which knows nothing of budgets: its writes are paced all the same."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "objdir_tier"))
    from objdir_tier import ObjdirTier

    register_tier("objdir-budgeted", ObjdirTier)
    obj = {
        "name": "obj",
        "kind": "objdir-budgeted",
        "path": f"objdir://{tmp_path}/bucket",
        "io": {"bandwidth": "32MB/s"},
        "compress": "none",  # the budget charges the bytes stored: all of them here
    }
    d = {"tiers": [{"name": "host", "kind": "host", "capacity": "64MiB"}, obj], "io": {"chunk": "1MiB"}}
    with Hierarchy.from_config(d) as h:
        budget = h.tier("obj").budget
        assert isinstance(budget, Budget) and budget.bytes_per_sec == 32e6
        assert budget.burst_bytes == h.tier("obj").geometry.chunk_bytes
        h.save(STATE, step=1).wait()
        assert stats(h, "obj").charged_bytes == blob_bytes(h, 1)


def test_two_ranks_commit_on_a_budgeted_shared_tier(tmp_path: Path, coordinators: Any, run_ranks: Any) -> None:
    cs = coordinators(2)
    d = {
        "tiers": [
            {"name": "host", "kind": "host", "capacity": "64MiB"},
            {
                "name": "pfs",
                "kind": "pfs",
                "path": str(tmp_path / "pfs"),
                "io": {"bandwidth": "32MB/s"},
                "compress": "none",
            },
        ],
        "io": {"chunk": "1MiB"},
    }

    def rank(r: int) -> tuple[list[int], int, int]:
        with Hierarchy.from_config(d, coordinator=cs[r], job="j") as h:
            for step in (1, 2):
                h.save({"w": torch.full((MiB // 2,), float(10 * step + r)), "step": step}, step=step).wait()
            back = h.restore(step=2, tier="pfs")
            assert torch.equal(back["w"], torch.full((MiB // 2,), float(20 + r)))
            return h.tier("pfs").list_records(), stats(h, "pfs").charged_bytes, blob_bytes(h, 1) + blob_bytes(h, 2)

    out = run_ranks(2, rank)
    for got in out:
        assert not isinstance(got, BaseException), got
        records, charged, nbytes = got
        assert records == [1, 2]
        assert charged == nbytes  # each rank's own tier object, its own bucket
