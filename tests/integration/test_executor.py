"""The rank executor carries the protocol's plans out and decides nothing (tierckpt.background.executor):
what it does when an action fails is the action's ``on_failure``, and what a promoted copy needs is the
protocol's ``promotion``; a legacy step (format 4, no record) is promoted like any other."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tierckpt import Hierarchy
from tierckpt.background.catalog import Catalog
from tierckpt.background.executor import RankExecutor
from tierckpt.background.listing import Listing
from tierckpt.errors import CheckpointNotFoundError, TierIOError
from tierckpt.policies.protocol import EvictCopy, OnFailure, RemoveRecord, ThisRank, WriteRecord
from tierckpt.ranks.commit import DecisionKeys
from tierckpt.ranks.coordinator import SoloCoordinator
from tierckpt.testing.faulty import FaultyTier
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.host import HostTier

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
EIO = TierIOError(5, "tier 'host': Input/output error")


def _executor(*tiers: HostTier | FaultyTier) -> RankExecutor:
    catalog = Catalog(tiers, 0)
    listing = Listing(tiers, catalog, ThisRank(0, 1, frozenset({0})))
    return RankExecutor(tiers, catalog, listing, SoloCoordinator(0, 1), DecisionKeys())


@pytest.mark.parametrize(
    ("on_failure", "done"),
    [("continue", ["evict", "write_record"]), ("stop", []), ("raise", None)],
)
def test_a_failed_action_does_what_the_action_says(on_failure: OnFailure, done: list[str] | None) -> None:
    """The same failure (the record cannot be removed) goes on, stops the plan or raises, as the action
    says: nothing in the executor tells the kinds of action apart."""
    tier = FaultyTier(HostTier("host"), fail={"remove_record": EIO})
    plan = [RemoveRecord("host", 3, on_failure=on_failure), EvictCopy("host", 3, 0), WriteRecord("host", 3)]
    ex = _executor(tier)
    if done is None:
        with pytest.raises(TierIOError):
            ex.carry_out(plan, b"record")
        return
    got = ex.carry_out(plan, b"record")
    assert got == plan[1:] if done else got == []
    assert [m for m in ("evict", "write_record") if tier.calls[m]] == done


def test_a_promotion_whose_source_lost_the_record_fails_and_leaves_no_copy() -> None:
    """The protocol's promotion rule, carried out: the source holds no record of a format-5 copy (the step
    was evicted there meanwhile): the promoted copy goes, and the promotion raises."""
    src, dst = HostTier("pfs"), HostTier("host")
    manifest = (GOLDEN / "v5" / "step-000000000001" / "rank-00000" / "manifest").read_bytes()
    key = CheckpointKey(1, 0)
    dst.reserve(key, []).commit(manifest)  # the promoted copy, in place before its record
    assert dst.holds(key)
    with pytest.raises(CheckpointNotFoundError, match="lost its commit record"):
        _executor(dst, src).promote(src, dst, key.step, manifest)
    assert not dst.holds(key)


def test_a_legacy_step_is_promoted_without_a_record(tmp_path: Path) -> None:
    """(d): a step of format 4 (no record: committed by itself) is prefetched to the host tier and listed
    there, restored from it. On 987543a the prefetch failed ("step 3 lost its commit record")."""
    shutil.copytree(GOLDEN / "v4", tmp_path / "pfs")
    cfg = {
        "tiers": [
            {"name": "host", "kind": "host", "capacity": "64MiB"},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
        "io": {"engine": "threads"},
    }
    with Hierarchy.from_config(cfg) as h:
        assert h.prefetch(step=3).result(timeout=60) == "host"
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [
            (s, ("host",) * (s == 3) + ("pfs",)) for s in (1, 2, 3, 4)
        ]
        h.restore(step=3)
        assert h.last_restore == (3, "host")
