"""The many-rank protocol's rules (tierckpt.policies.protocol), without I/O: one test per row of
docs/distributed.md's "Failures" table (named after the row), the three audit bugs of the previous issue
as regression cases, and the rules the outside audit's findings 4 and 6 needed."""

from __future__ import annotations

import pytest

from tierckpt.errors import CoordinationError, TierIOError
from tierckpt.format.record import CommitRecord
from tierckpt.policies.protocol import (
    Action,
    CopyState,
    EvictCopy,
    Fail,
    Keep,
    RemoveRecord,
    ThisRank,
    TierHoldings,
    Warn,
    WriteRecord,
    commits_alone,
    committed_actions,
    decide_commit,
    deciding_actions,
    deciding_eviction,
    deletion,
    eviction,
    failed_commit_actions,
    listed_steps,
    lister,
    lone_commit,
    orphan,
    own_unrecorded,
    promotion,
    rank_evictions,
    removes_record,
    resharded_steps,
    seen_by,
    shared_decision,
    still_unknown,
    stray_copies,
    sweeps_strays,
    unknown_outcome,
    unowned_ranks,
    unrecorded_copies,
    unwritten_record_actions,
)

STEP = 7
TAGS = [11, 22, 33, 44]  # ranks 0-3's manifest tags
#: a job of 4 ranks on two nodes: ranks 0-1 on node 0, 2-3 on node 1
RANKS = [ThisRank(r, 4, frozenset({0, 1} if r < 2 else {2, 3})) for r in range(4)]


def kinds(actions: list[object]) -> list[str]:
    return [type(a).__name__ for a in actions]


def restarted(step: int = STEP, *, record: bool = False) -> TierHoldings:
    """What a restarted job's rank finds of ``step`` on a tier: its copy, with or without the record."""
    return TierHoldings("pfs", frozenset({step}), frozenset({step}) if record else frozenset(), {}, {})


# -- the rows of the failure table ------------------------------------------------------------------------
def test_a_ranks_copy_fails() -> None:
    """It reports "failed" at once: rank 0 fails the commit naming it; not listed; each rank evicts its
    own copy (on a shared tier rank 0 removes the record, on a node-local one every rank its node's)."""
    outcome = decide_commit(STEP, [11, None, 33, 44])
    assert not outcome.committed and outcome.failed == (1,)
    assert deciding_actions("pfs", True, outcome) == [RemoveRecord("pfs", STEP)]
    assert deciding_actions("ssd", False, outcome) == []
    for me in RANKS:
        shared = failed_commit_actions("pfs", True, STEP, me, undecided=False)
        assert shared == ([RemoveRecord("pfs", STEP)] if me.rank == 0 else []) + [EvictCopy("pfs", STEP, me.rank)]
        local = failed_commit_actions("ssd", False, STEP, me, undecided=False)
        assert local == [RemoveRecord("ssd", STEP), EvictCopy("ssd", STEP, me.rank)]
    assert listed_steps(TierHoldings("pfs", frozenset({STEP})), 4) == []


def test_a_rank_dies_while_writing_its_blobs() -> None:
    """The commit fails after the timeout with a known outcome (the dead rank did not arrive): the others
    evict their copies; the dead rank has no copy in place (no manifest), so nothing of it is listed."""
    for me in RANKS[:3]:
        plan = failed_commit_actions("ssd", False, STEP, me, undecided=False, why="rank(s) 3 did not arrive")
        assert plan == [RemoveRecord("ssd", STEP), EvictCopy("ssd", STEP, me.rank)]
    assert listed_steps(TierHoldings("ssd"), 4) == [] and unrecorded_copies(TierHoldings("ssd")) == []


def test_a_rank_dies_with_its_copy_durable_before_it_reports_it() -> None:
    """Its copy has no record: not listed; an orphan the restarted job removes (a copy it never wrote),
    and, restarted on fewer ranks, rank 0 removes it as a stray."""
    left = restarted()
    assert listed_steps(left, 4) == [] and unrecorded_copies(left) == [STEP]
    assert orphan("pfs", STEP, RANKS[3], False, CopyState()) == EvictCopy("pfs", STEP, 3)
    everyone = TierHoldings("pfs", frozenset(), frozenset(), ranks={STEP: frozenset({3})}, step_versions={STEP: 5})
    assert stray_copies(everyone, ThisRank(0, 2)) == [EvictCopy("pfs", STEP, 3)]


def test_a_rank_dies_after_reporting_its_copy_before_it_learns_the_outcome() -> None:
    """Rank 0 has every copy: committed (on a node-local tier the dead rank's node-mates write their
    node's record); the restarted job lists it."""
    outcome = decide_commit(STEP, TAGS)
    assert outcome.committed and outcome.record == CommitRecord(STEP, 4, tuple(TAGS))
    assert deciding_actions("pfs", True, outcome) == [WriteRecord("pfs", STEP)]
    assert committed_actions("ssd", False, outcome) == [WriteRecord("ssd", STEP)]  # rank 2, for node 1
    assert committed_actions("pfs", True, outcome) == []
    assert listed_steps(restarted(record=True), 4) == [STEP]


def test_a_rank_cannot_write_its_nodes_record_of_a_committed_step() -> None:
    """The commit is decided; one rank's write of its node's record fails: its copy and the record (the
    node's other ranks write the same bytes; rank 0 may have returned on it) stay, with a warning; if no
    rank of the node wrote it, the unrecorded copy, failed in this hierarchy's catalog, is an orphan."""
    for me in RANKS:
        plan = unwritten_record_actions("ssd", STEP, me, "[Errno 5] Input/output error")
        assert kinds(plan) == ["Keep", "Warn"] and isinstance(plan[0], Keep) and plan[0].rank == me.rank
        assert isinstance(plan[1], Warn) and "Input/output error" in plan[1].message
        assert orphan("ssd", STEP, me, True, CopyState("failed")) == Keep(
            "ssd", STEP, me.rank, "its commit record is there"
        )
        assert orphan("ssd", STEP, me, False, CopyState("failed")) == EvictCopy("ssd", STEP, me.rank)


def test_rank_0_dies_in_the_commits_gather_before_publishing_the_outcome() -> None:
    """The others' outcome is unknown: they keep their copies (warned); no record, not listed; once
    restarted (or once rank 0 published a later commit there), each copy is an orphan."""
    for me in RANKS[1:]:
        plan = failed_commit_actions("pfs", True, STEP, me, undecided=True, why="rank 0 published no outcome")
        assert kinds(plan) == ["Keep", "Warn"] and plan[0] == Keep(
            "pfs", STEP, me.rank, "the commit's outcome is unknown"
        )
        assert isinstance(plan[1], Warn) and "rank 0 published no outcome" in plan[1].message
        assert isinstance(orphan("pfs", STEP, me, False, CopyState("failed", unknown=True)), Keep)
        assert orphan("pfs", STEP, me, False, CopyState()) == EvictCopy("pfs", STEP, me.rank)  # restarted
    assert listed_steps(restarted(), 4) == []


def test_rank_0_dies_after_writing_the_record_before_publishing() -> None:
    """The record and every copy are complete: committed and listed; the others kept their copies."""
    assert kinds(failed_commit_actions("pfs", True, STEP, RANKS[2], undecided=True)) == ["Keep", "Warn"]
    assert listed_steps(restarted(record=True), 4) == [STEP]
    assert isinstance(orphan("pfs", STEP, RANKS[2], True, CopyState("failed", unknown=True)), Keep)


def test_a_rank_dies_during_the_background_demotion_to_a_lower_tier() -> None:
    """That tier's commit fails naming the rank: the others evict their copies there; the upper tier
    keeps the step listed."""
    for me in RANKS[1:3]:
        assert failed_commit_actions("pfs", True, STEP, me, undecided=False) == [EvictCopy("pfs", STEP, me.rank)]
    ssd = TierHoldings("ssd", frozenset({STEP}), frozenset({STEP}))
    assert listed_steps(ssd, 4) == [STEP]


def test_a_rank_dies_after_its_commit_returned() -> None:
    """Committed: listed and restored by the restarted job, never an orphan."""
    assert listed_steps(restarted(record=True), 4) == [STEP] and unrecorded_copies(restarted(record=True)) == []


def test_a_rank_hangs_past_the_timeout_then_goes_on() -> None:
    """As for a dead rank (a known failure): every rank evicts its copy, the hung one too once its late
    report gets the failure."""
    for me in RANKS:
        assert failed_commit_actions("ssd", False, STEP, me, undecided=False)[-1] == EvictCopy("ssd", STEP, me.rank)


def test_rank_0_hangs_in_the_decision_then_goes_on() -> None:
    """Unknown outcome: kept. If rank 0 writes the record, the step is committed; if not, the copies are
    orphans once rank 0 has published a later commit on that tier (not after a later commit that fails
    because rank 0 does not answer)."""
    unknown = {(STEP, "pfs"), (STEP, "ssd")}
    assert still_unknown(unknown, "pfs", published=False) == unknown  # rank 0 did not answer again
    assert still_unknown(unknown, "pfs", published=True) == {(STEP, "ssd")}
    me = RANKS[1]
    assert isinstance(orphan("pfs", STEP, me, True, CopyState("failed", unknown=True)), Keep)  # it wrote it
    assert orphan("pfs", STEP, me, False, CopyState("failed")) == EvictCopy("pfs", STEP, 1)  # settled, no record


def test_a_step_is_saved_again_and_its_commit_fails() -> None:
    """The step's record goes (it named the replaced copies): rank 0 removes it on a shared tier before
    publishing the failure, each rank its node's on a node-local one; the step is no longer listed."""
    failed = decide_commit(STEP, [11, 22, None, 44])
    assert deciding_actions("pfs", True, failed) == [RemoveRecord("pfs", STEP)]
    assert failed_commit_actions("ssd", False, STEP, RANKS[3], undecided=False)[0] == RemoveRecord("ssd", STEP)
    assert listed_steps(restarted(record=False), 4) == []


# -- the previous issue's audit bugs ----------------------------------------------------------------------
def test_regression_an_unknown_outcome_copy_is_kept_until_rank_0_publishes_a_later_commit_on_that_tier() -> None:
    """(a) The protection lasts until rank 0 publishes a later commit on *that* tier: not a later failure,
    a promotion (no decision of rank 0) or a commit on another tier."""
    unknown = {(STEP, "pfs")}
    copy = CopyState("failed", unknown=True)
    assert isinstance(orphan("pfs", STEP, RANKS[1], False, copy), Keep)
    assert still_unknown(unknown, "pfs", published=False) == unknown
    assert still_unknown(unknown, "ssd", published=True) == unknown
    assert still_unknown(unknown, "pfs", published=True) == set()


def test_regression_a_rank_making_room_on_a_full_shared_tier_removes_the_steps_record() -> None:
    """(b) A rank evicting its copy alone for room on a full shared tier removes the step's record first
    (a record never names a copy that is gone: the step would stay listed, unreadable); retention's
    shared evictions leave the record to rank 0's decision."""
    me = RANKS[2]
    assert removes_record(True, 4, alone=True) and not removes_record(True, 4)
    alone = eviction("pfs", STEP, me, shared=True, alone=True, saved_world_size=4)
    assert alone == [RemoveRecord("pfs", STEP), EvictCopy("pfs", STEP, 2)]
    assert eviction("pfs", STEP, me, shared=True) == [EvictCopy("pfs", STEP, 2)]


def test_regression_node_local_copies_are_not_kept_forever() -> None:
    """(c) Two ranks of a node race on the record: the one that finds its committed copy without the
    record evicts it (unless a transfer reads it); a job restarted on another world size evicts the
    copies of the ranks it does not own."""
    me = RANKS[1]
    assert orphan("ssd", STEP, me, False, CopyState("committed")) == EvictCopy("ssd", STEP, 1)
    assert isinstance(orphan("ssd", STEP, me, False, CopyState("committed", pinned=True)), Keep)
    # each rank of the node removes the record itself (idempotent), then its own copy
    assert eviction("ssd", STEP, me, shared=False) == [RemoveRecord("ssd", STEP), EvictCopy("ssd", STEP, 1)]
    two = ThisRank(1, 2, frozenset({1}))  # restarted on 2 ranks, one a node: rank 1 on node 1
    assert unowned_ranks(4, two, shared=False) == [0, 2, 3]
    assert unowned_ranks(4, two, shared=True) == [2, 3]
    assert eviction("ssd", STEP, two, shared=False, saved_world_size=4) == [
        RemoveRecord("ssd", STEP), EvictCopy("ssd", STEP, 1), EvictCopy("ssd", STEP, 0), EvictCopy("ssd", STEP, 2),
        EvictCopy("ssd", STEP, 3),
    ]  # fmt: skip
    assert unowned_ranks(4, RANKS[0], shared=False) == []  # the same world size: every rank its own


# -- the other rules --------------------------------------------------------------------------------------
def test_a_deletion_removes_every_tiers_record_before_any_copy() -> None:
    """``Hierarchy.delete``: each tier's eviction, the records of all of them first (in tier order), then
    the copies; a record that cannot be removed stops the plan before any copy (on_failure ``stop``).
    Rank 2 of 4: the shared pfs's record was removed by rank 0 (its plan has the copy only)."""
    me = RANKS[2]
    plans = [
        eviction("host", STEP, me, shared=False),
        eviction("ssd", STEP, me, shared=False, saved_world_size=4),
        eviction("pfs", STEP, me, shared=True),
    ]
    assert deletion(plans) == [
        RemoveRecord("host", STEP), RemoveRecord("ssd", STEP),
        EvictCopy("host", STEP, 2), EvictCopy("ssd", STEP, 2), EvictCopy("pfs", STEP, 2),
    ]  # fmt: skip
    assert [a.on_failure for a in deletion(plans)[:2]] == ["stop", "stop"]
    assert deletion([]) == []


def test_an_orphan_is_judged_as_the_copy_is_when_it_is_evicted() -> None:
    """Finding 6's race: a copy listed without a record (a killed commit's orphan) whose step this
    hierarchy then saved again is not evicted: while the new copy is written (its state), nor once its
    record is there; a record that cannot be read keeps it too."""
    me = RANKS[0]
    for state in ("pending", "writing", "evicting"):
        assert isinstance(orphan("pfs", STEP, me, False, CopyState(state)), Keep)
    assert isinstance(orphan("pfs", STEP, me, True, CopyState("committed")), Keep)
    assert isinstance(orphan("pfs", STEP, me, None, CopyState()), Keep)
    assert orphan("pfs", STEP, me, False, CopyState("failed")) == EvictCopy("pfs", STEP, 0)


def test_shared_evictions_are_rank_0s_decision_sent_with_a_commit() -> None:
    plan = [("ssd", 1), ("pfs", 1), ("ssd", 2)]
    assert shared_decision(plan, {"pfs"}) == [("pfs", 1)]
    assert rank_evictions(plan, {"pfs"}, 4, None) == [("ssd", 1), ("ssd", 2)]  # no commit: shared tiers wait
    assert rank_evictions(plan, {"pfs"}, 4, [("pfs", 0)]) == [("ssd", 1), ("ssd", 2), ("pfs", 0)]
    assert rank_evictions(plan, {"pfs"}, 1, None) == plan  # a rank alone decides alone
    actions, unowned = deciding_eviction("pfs", 1, ThisRank(0, 2), saved_world_size=4)
    assert actions == [RemoveRecord("pfs", 1)] and unowned == [2, 3]
    assert eviction("pfs", 1, ThisRank(0, 2), shared=True, unowned=unowned) == [
        EvictCopy("pfs", 1, 0), EvictCopy("pfs", 1, 2), EvictCopy("pfs", 1, 3),
    ]  # fmt: skip


def test_a_tier_lists_legacy_copies_and_steps_saved_by_another_number_of_ranks() -> None:
    holdings = TierHoldings(
        "ssd",
        own=frozenset({1, 2, 3}),
        records=frozenset({3, 4, 5, 6}),
        record_sizes={4: 2, 5: 4, 6: None},  # 6: unreadable
        versions={1: 4, 2: 5},  # 1: written before records existed
    )
    assert listed_steps(holdings, 4) == [1, 3, 4]
    assert resharded_steps(holdings, 4) == [4]
    assert unrecorded_copies(holdings) == [2]


def test_strays_are_copies_of_ranks_beyond_the_job_no_record_names() -> None:
    """Finding 4: one rank looks (rank 0 on a shared tier, a node's lowest rank on its node-local one), at
    copies of ranks beyond this job's world size of steps without a record (2) or whose record names fewer
    ranks (3: saved again by this job); a record naming them (1) or unreadable (4) leaves them to the
    step's eviction."""
    listing = TierHoldings(
        "pfs",
        records=frozenset({1, 3, 4}),
        record_sizes={1: 8, 3: 2, 4: None},
        ranks={s: frozenset({0, 1, 2, 3}) for s in (1, 2, 3, 4)},
        step_versions={2: 5},
    )
    assert stray_copies(listing, ThisRank(0, 2)) == [EvictCopy("pfs", s, r) for s in (2, 3) for r in (2, 3)]
    assert stray_copies(TierHoldings("pfs", records=frozenset({1})), ThisRank(0, 2)) == []  # not every rank's
    assert sweeps_strays(ThisRank(0, 2), shared=True) and not sweeps_strays(ThisRank(1, 2), shared=True)
    assert sweeps_strays(ThisRank(2, 4, frozenset({2, 3})), shared=False)
    assert not sweeps_strays(ThisRank(3, 4, frozenset({2, 3})), shared=False)


#: a 2-rank directory of four record-less steps, listed by rank 0 of a job of 1 rank (every rank's copies)
TWO_RANKS = {s: frozenset({0, 1}) for s in (1, 2, 3, 4)}


def recordless(step_versions: dict[int, int | None]) -> TierHoldings:
    return TierHoldings("pfs", frozenset(TWO_RANKS), ranks=TWO_RANKS, versions={s: 4 for s in TWO_RANKS},
                        step_versions=step_versions)  # fmt: skip


def test_a_legacy_step_of_ranks_beyond_the_job_is_not_a_stray() -> None:
    """B1 (the audit's f4legacy): copies of format 4 and older have no record and are committed by
    themselves (listed_steps lists them): a record-less step of such a format is never swept."""
    legacy = recordless({1: 4, 2: 3, 3: 1, 4: 4})
    assert stray_copies(legacy, ThisRank(0, 1)) == []
    assert listed_steps(legacy, 1) == [1, 2, 3, 4]


def test_a_recordless_step_whose_version_cannot_be_read_is_not_a_stray() -> None:
    """B1: what cannot be told apart is kept: a version that could not be read (None), or was never read
    (a step the listing has no version of)."""
    assert stray_copies(recordless({1: None, 2: None}), ThisRank(0, 1)) == []
    assert stray_copies(recordless({}), ThisRank(0, 1)) == []


def test_a_recordless_step_of_a_format_with_records_is_a_stray() -> None:
    """B1: a record-less step of format 5 or later beyond this job's ranks is a larger job's uncommitted
    step: its copies of ranks beyond this job go (finding 4), next to legacy and unreadable ones that stay."""
    assert stray_copies(recordless({1: 4, 2: None, 3: 5, 4: 6}), ThisRank(0, 1)) == [
        EvictCopy("pfs", 3, 1), EvictCopy("pfs", 4, 1),
    ]  # fmt: skip


# -- what the executor only carries out ----------------------------------------------------------------------
def test_a_rank_alone_commits_at_once_without_a_gather() -> None:
    """The path a commit takes: a job of one rank decides its own commit (the record written once, by
    rank 0's actions on a shared tier, by every rank's on a node-local one); any other gathers."""
    assert commits_alone(ThisRank(0, 1)) and not commits_alone(RANKS[0])
    outcome, plan = lone_commit("pfs", True, STEP, 11)
    assert outcome.record == CommitRecord(STEP, 1, (11,)) and plan == [WriteRecord("pfs", STEP)]
    assert lone_commit("ssd", False, STEP, 11)[1] == [WriteRecord("ssd", STEP)]


def test_an_unknown_outcome_is_a_coordination_error_that_says_rank_0_may_have_decided() -> None:
    assert unknown_outcome(CoordinationError("rank 0 published no outcome", (0,), undecided=True))
    assert not unknown_outcome(CoordinationError("rank(s) 3 did not arrive", (3,)))
    assert not unknown_outcome(TierIOError(5, "tier 'pfs': EIO"))


def _failures(plan: list[Action]) -> list[tuple[str, str]]:
    return [(type(a).__name__, a.on_failure) for a in plan if isinstance(a, (WriteRecord, RemoveRecord, EvictCopy))]


def test_what_a_failed_action_does_is_the_rules_data() -> None:
    """A record that cannot be written fails the operation; one that cannot be removed stops the plan (the
    copies it names stay); a copy that cannot go is left, and the plan goes on."""
    committed, failed = decide_commit(STEP, TAGS), decide_commit(STEP, [11, None, 33, 44])
    assert _failures(deciding_actions("pfs", True, committed)) == [("WriteRecord", "raise")]
    assert _failures(committed_actions("ssd", False, committed)) == [("WriteRecord", "raise")]
    assert _failures(promotion("host", STEP, RANKS[1], recorded=True, version=5)) == [("WriteRecord", "raise")]
    assert _failures(deciding_actions("pfs", True, failed)) == [("RemoveRecord", "stop")]
    assert _failures(failed_commit_actions("ssd", False, STEP, RANKS[1], undecided=False)) == [
        ("RemoveRecord", "stop"), ("EvictCopy", "continue"),
    ]  # fmt: skip
    assert _failures(eviction("ssd", STEP, ThisRank(1, 2, frozenset({1})), shared=False, saved_world_size=4)) == [
        ("RemoveRecord", "stop"), *[("EvictCopy", "continue")] * 4,
    ]  # fmt: skip
    assert _failures(deciding_eviction("pfs", STEP, RANKS[0], 4)[0]) == [("RemoveRecord", "stop")]


@pytest.mark.parametrize("version", [4, 1])
def test_a_promoted_legacy_copy_needs_no_record(version: int) -> None:
    """A copy of format 4 or older is committed by itself: promoted, it needs no record (on 987543a its
    prefetch failed: "lost its commit record")."""
    assert promotion("host", STEP, RANKS[0], recorded=False, version=version) == []


def test_a_promoted_copy_brings_its_steps_record_or_fails() -> None:
    """A copy of a format with records takes the step's record along; without one there (the step was
    evicted from the source meanwhile), or of a version that cannot be read, the promoted copy goes and the
    promotion fails."""
    assert promotion("host", STEP, RANKS[2], recorded=True, version=5) == [WriteRecord("host", STEP)]
    for version in (5, None):
        plan = promotion("host", STEP, RANKS[2], recorded=False, version=version)
        assert plan[0] == EvictCopy("host", STEP, 2) and isinstance(plan[1], Fail) and len(plan) == 2
        assert f"step {STEP} lost its commit record" in plan[1].why


# -- tiers listed by one rank (docs/distributed.md, "Tiers listed by one rank") ---------------------------
@pytest.mark.parametrize("rank", range(4))
def test_a_tier_whose_listing_is_not_cheap_is_listed_by_one_rank_of_those_sharing_it(rank: int) -> None:
    me = RANKS[rank]
    assert lister(me, shared=True, cheap=False, ranks_meet=True, nodes_meet=True) == 0
    assert lister(me, shared=False, cheap=False, ranks_meet=True, nodes_meet=True) == (0 if rank < 2 else 2)
    assert lister(me, shared=False, cheap=False, ranks_meet=True, nodes_meet=True) == (
        me.rank if sweeps_strays(me, shared=False) else min(me.node_ranks)
    )
    # each rank lists itself: a cheap listing, ranks that decide alone, no node exchange, a rank alone
    assert lister(me, shared=True, cheap=True, ranks_meet=True, nodes_meet=True) is None
    assert lister(me, shared=True, cheap=False, ranks_meet=False, nodes_meet=True) is None
    assert lister(me, shared=False, cheap=False, ranks_meet=True, nodes_meet=False) is None
    assert lister(ThisRank(0, 1), shared=True, cheap=False, ranks_meet=True, nodes_meet=True) is None


def test_each_rank_sees_in_the_listing_of_every_rank_what_its_own_listing_would_show() -> None:
    # steps 1-2 committed by 4 ranks, 3 by a job of 2 (ranks 0-1), 4 without a record (a save killed in
    # its commit, ranks 0-2 durable), 5 a legacy step of rank 3 alone (format 4, no record)
    every = TierHoldings(
        "obj",
        records=frozenset({1, 2, 3}),
        record_sizes={1: 4, 2: 4, 3: 2},
        ranks={1: frozenset(range(4)), 2: frozenset(range(4)), 3: frozenset({0, 1}), 4: frozenset({0, 1, 2}),
               5: frozenset({3})},
        step_versions={4: 5, 5: 4},
    )  # fmt: skip
    assert [own_unrecorded(every, r) for r in range(4)] == [[4], [4], [4], [5]]
    views = [seen_by(every, r, {4: 5, 5: 4}) for r in range(4)]
    assert [sorted(v.own) for v in views] == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 4], [1, 2, 5]]
    assert [dict(v.record_sizes) for v in views] == [{}, {}, {3: 2}, {3: 2}]
    assert [dict(v.versions) for v in views] == [{4: 5}, {4: 5}, {4: 5}, {5: 4}]
    assert all(v.records == every.records and v.ranks is None for v in views)
    assert [listed_steps(v, 4) for v in views] == [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3, 5]]
    assert [unrecorded_copies(v) for v in views] == [[4], [4], [4], []]
