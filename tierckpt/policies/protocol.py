"""The many-rank protocol: every rank-wide decision about copies and commit records, as pure rules.

A step is committed on a tier once the tier holds its commit record (docs/distributed.md, "The global
commit, step by step"). Who writes that record, who removes it, whose copies go when a step is evicted,
which copies nothing will ever list again (orphans) and which must stay because a commit's outcome is
unknown: each of these is decided here, from plain records, with no I/O. The rank executor
(:class:`~tierckpt.background.executor.RankExecutor`) reads what a rule needs from the tiers (through
:func:`tierckpt.tiers.holdings.read_holdings`) and from the catalog, calls the rule, and carries out the
actions it returns, in order, each failure as the action says (:data:`OnFailure`); it decides nothing
itself. Like :func:`~tierckpt.policies.place`, which decides what moves where, and like etcd's raft (a
pure state machine whose ``Ready()`` hands the application what to persist and send): inputs are data,
outputs are plans.

===========================================  ============================================================
rule                                         decides
===========================================  ============================================================
:func:`commits_alone`, :func:`lone_commit`   which path a commit takes: a rank alone decides at once, else
                                             the gather of every rank's report
:func:`decide_commit`                        rank 0, from every rank's report: committed, or failed naming
                                             the ranks
:func:`deciding_actions`                     what rank 0 does on the tier before it publishes that outcome
                                             (shared tier: write the record, or remove the step's old one)
:func:`committed_actions`                    what each rank does once it learns the step is committed
                                             (node-local tier: write its node's record)
:func:`failed_commit_actions`                what a failed commit leaves, and who removes it; an unknown
                                             outcome keeps the copy
:func:`unknown_outcome`,                     which failures leave a commit's outcome unknown, and until when
:func:`still_unknown`                        such a copy is kept (rank 0 published a later commit on that
                                             tier)
:func:`unwritten_record_actions`             a rank that cannot write its node's record of a committed step:
                                             its copy and the record stay (other ranks rely on them)
:func:`promotion`                            what a copy promoted up the chain needs: the step's record
                                             (none for format 4 and older)
:func:`listed_steps`,                        which steps a tier lists for this rank: its copies with a
:func:`resharded_steps`                      record, legacy copies (format 4 and older), steps saved by
                                             another number of ranks (listed by their record alone)
:func:`unrecorded_copies`, :func:`orphan`    which record-less copies of this rank go (orphans), and which
                                             stay (a commit in flight, an unknown outcome, a copy a
                                             transfer reads)
:func:`rank_evictions`,                      retention: shared tiers evict what rank 0 decides with a commit
:func:`shared_decision`,                     (it removes the records first); node-local tiers: each rank
:func:`deciding_eviction`                    its own window
:func:`removes_record`, :func:`eviction`     who removes an evicted step's record (a rank making room on a
                                             full shared tier removes it too), and which copies the evicting
                                             rank removes: its own, and those of ranks no rank of this job
                                             owns after a world-size change (:func:`unowned_ranks`)
:func:`deletion`                             a step deleted from several tiers at once (``Hierarchy.delete``):
                                             every tier's record before any copy
:func:`sweeps_strays`, :func:`stray_copies`  copies of ranks beyond this job's world size no record names
                                             (a larger job killed before it committed; never of format 4
                                             and older, committed by themselves): who removes them
:func:`lister`, :func:`seen_by`              who lists a tier whose listing is not cheap (an object store)
                                             for the ranks that share it, once, and what each of those
                                             ranks takes from that listing of every rank's copies
===========================================  ============================================================
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tierckpt.errors import CoordinationError
from tierckpt.format.record import RECORDS_SINCE, CommitRecord
from tierckpt.policies.rankplans import (
    Action,
    CopyState,
    EvictCopy,
    Fail,
    Keep,
    OnFailure,
    RemoveRecord,
    ThisRank,
    TierHoldings,
    Warn,
    WriteRecord,
)

__all__ = [
    "Action",
    "CommitOutcome",
    "CopyState",
    "EvictCopy",
    "Fail",
    "Keep",
    "OnFailure",
    "RemoveRecord",
    "ThisRank",
    "TierHoldings",
    "Warn",
    "WriteRecord",
    "commits_alone",
    "committed_actions",
    "decide_commit",
    "deciding_actions",
    "deciding_eviction",
    "deletion",
    "eviction",
    "failed_commit_actions",
    "listed_steps",
    "lister",
    "lone_commit",
    "orphan",
    "own_steps",
    "own_unrecorded",
    "promotion",
    "rank_evictions",
    "removes_record",
    "resharded_steps",
    "seen_by",
    "shared_decision",
    "still_unknown",
    "stray_copies",
    "sweeps_strays",
    "unknown_outcome",
    "unowned_ranks",
    "unrecorded_copies",
]


# -- the commit ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommitOutcome:
    """Rank 0's decision of one commit, from every rank's report.

    Attributes:
        step: the step.
        record: the record to publish when every rank's copy is in (None: failed).
        failed: the ranks whose copies failed (empty when committed).
    """

    step: int
    record: CommitRecord | None
    failed: tuple[int, ...] = ()

    @property
    def committed(self) -> bool:
        """Whether the step is committed."""
        return self.record is not None


def decide_commit(step: int, tags: Sequence[int | None]) -> CommitOutcome:
    """Rank 0's decision: committed when every rank reported its copy's manifest tag (``tags[r]``, None
    for a copy that failed), with a record naming each; else failed, naming the ranks that failed."""
    failed = tuple(r for r, t in enumerate(tags) if t is None)
    if failed or not tags:
        return CommitOutcome(step, None, failed)
    return CommitOutcome(step, CommitRecord(step, len(tags), tuple(t for t in tags if t is not None)))


def commits_alone(me: ThisRank) -> bool:
    """Whether this rank decides its commits alone (:func:`lone_commit`), without the gather of every
    rank's report: a job of one rank."""
    return me.world_size == 1


def lone_commit(tier: str, shared: bool, step: int, tag: int) -> tuple[CommitOutcome, list[Action]]:
    """A rank alone commits its copy (manifest tag ``tag``) at once: the outcome, and rank 0's actions
    then every rank's (:func:`deciding_actions`, :func:`committed_actions`: the record, written once)."""
    outcome = decide_commit(step, [tag])
    return outcome, deciding_actions(tier, shared, outcome) + committed_actions(tier, shared, outcome)


def deciding_actions(tier: str, shared: bool, outcome: CommitOutcome) -> list[Action]:
    """What rank 0 does on ``tier`` before any rank learns ``outcome``. On a shared tier it writes the
    record (so that once any rank's ``wait()`` returns, the step is listed on every rank), or, on a
    failure, removes the step's record: a step saved again whose commit failed must not stay listed by
    a record naming the copies this save replaced. A node-local tier: nothing (each rank writes its
    node's record, :func:`committed_actions`)."""
    if not shared:
        return []
    if outcome.committed:
        return [WriteRecord(tier, outcome.step)]
    return [RemoveRecord(tier, outcome.step)]


def committed_actions(tier: str, shared: bool, outcome: CommitOutcome) -> list[Action]:
    """What every rank does once it learns that ``outcome`` committed the step: on a node-local tier it
    writes the record it received into its node's directory (the same bytes from each rank of a node:
    an atomic replace); on a shared tier rank 0 wrote it already."""
    return [] if shared or not outcome.committed else [WriteRecord(tier, outcome.step)]


def failed_commit_actions(
    tier: str, shared: bool, step: int, me: ThisRank, *, undecided: bool, why: str = ""
) -> list[Action]:
    """What a rank does with its copy of ``step`` when the step's commit on ``tier`` failed (``why``).

    A failure whose outcome is known (a copy failed, a rank did not arrive, rank 0 never took the decision
    up): the step's record goes (a record names every rank's copy; on a shared tier rank 0 removes it, one
    metadata operation instead of one a rank), then this rank's copy. An unknown outcome (``undecided``:
    rank 0 took the decision up and published nothing in time, so it may have written the record): the
    copy stays, since the step may be committed (evicting it would leave a record naming a copy that is
    gone); if no record ever comes, it is an orphan (:func:`orphan`) once :func:`still_unknown` lets it go.
    """
    if undecided:
        return [
            Keep(tier, step, me.rank, "the commit's outcome is unknown"),
            Warn(
                f"step {step} on tier {tier!r}: the commit's outcome is unknown ({why}); this rank's copy stays, "
                "and is removed by retention unless the step's record is there"
            ),
        ]
    out: list[Action] = []
    if not shared or me.rank == 0:
        out.append(RemoveRecord(tier, step))
    out.append(EvictCopy(tier, step, me.rank))
    return out


def unwritten_record_actions(tier: str, step: int, me: ThisRank, why: str) -> list[Action]:
    """What a rank does when the commit of ``step`` on the node-local ``tier`` succeeded (rank 0 decided it
    for every rank) but its own write of its node's record failed (``why``). The step is committed: the
    other ranks of the node write the same record into the same directory, and rank 0 may have returned
    on it (a DCP save durable on this tier). Removing that record, or this rank's copy it names, would
    undo a commit other ranks rely on; both stay. Where no rank of the node wrote the record, this copy
    is unrecorded, and the retention pass removes it (:func:`orphan`: its commit failed here)."""
    return [
        Keep(tier, step, me.rank, "the step is committed; its node's record may be another rank's"),
        Warn(
            f"step {step} on tier {tier!r}: committed, but this rank could not write its node's commit record "
            f"({why}); the copy stays (another rank of the node writes the same record)"
        ),
    ]


def unknown_outcome(error: BaseException) -> bool:
    """Whether a commit that failed with ``error`` has an unknown outcome (rank 0 took the decision up and
    published nothing in time: it may have written the record). The copy then stays
    (:func:`failed_commit_actions` with ``undecided``) and is no orphan while :func:`still_unknown` keeps
    it; the hierarchy's catalog tracks it as such."""
    return isinstance(error, CoordinationError) and error.undecided


def still_unknown(unknown: Collection[tuple[int, str]], tier: str, *, published: bool) -> set[tuple[int, str]]:
    """The copies (step, tier) whose commit outcome stays unknown once a commit on ``tier`` has ended.
    Only a commit rank 0 published (``published``) settles those on its tier: rank 0 decides a tier's
    commits in order, on that tier's worker, so it is then past every earlier decision there (the earlier
    record is there, or never will be). Nothing else does: not a local failure, nor a commit that failed
    because rank 0 did not answer (it may still be writing the earlier record), nor a promotion."""
    return {(s, t) for s, t in unknown if t != tier or not published}


def promotion(tier: str, step: int, me: ThisRank, *, recorded: bool, version: int | None) -> list[Action]:
    """What this rank's copy of ``step`` promoted to ``tier`` (a cache of it up the chain: no commit of
    all ranks) needs there: the step's record from the tier it was read from (``recorded``: that tier
    holds it), which names this copy's manifest as it names the source's; nothing for a copy of format 4
    or older (``version``: committed by itself). A copy of a format with records whose source lost the
    record meanwhile (the step was evicted there) is not committed: the promoted copy goes and the
    promotion fails."""
    if recorded:
        return [WriteRecord(tier, step)]
    if _legacy(version):
        return []
    return [
        EvictCopy(tier, step, me.rank),
        Fail(f"step {step} lost its commit record on the tier it was promoted from (evicted there meanwhile)"),
    ]


# -- what a tier lists ---------------------------------------------------------------------------------
def listed_steps(holdings: TierHoldings, world_size: int) -> list[int]:
    """The steps a tier lists for this rank, oldest first: its copies whose step's record the tier
    holds; its copies written before records existed (format version below
    :data:`~tierckpt.format.record.RECORDS_SINCE`: committed by themselves); and the steps recorded there
    by a job of another number of ranks (this rank restores them by resharding other ranks' copies,
    wherever they are: on a node-local tier the node's directory may lack them)."""
    out = set(holdings.own & holdings.records)
    out |= {s for s in holdings.own - holdings.records if _legacy(holdings.versions.get(s))}
    return sorted(out | set(resharded_steps(holdings, world_size)))


def resharded_steps(holdings: TierHoldings, world_size: int) -> list[int]:
    """Of :func:`listed_steps`, those listed for this rank only because their record names another
    number of ranks: the tier holds no copy of this rank, and a restore reads other ranks' copies, which
    a node-local tier may not hold either (they are on the saving job's other nodes)."""
    return sorted(s for s in holdings.records - holdings.own if holdings.record_sizes.get(s) not in (None, world_size))


def unrecorded_copies(holdings: TierHoldings) -> list[int]:
    """This rank's copies that are not committed: no record, and not of a legacy version. Each is a
    commit in flight, one that never completed, or one whose record another rank removed (it evicted
    the step); :func:`orphan` says which go."""
    return sorted(s for s in holdings.own - holdings.records if not _legacy(holdings.versions.get(s)))


def _legacy(version: int | None) -> bool:
    return version is not None and version < RECORDS_SINCE


def _recorded_format(version: int | None) -> bool:
    """Whether a copy of this format version is committed by a record only (None: unknown, so no)."""
    return version is not None and version >= RECORDS_SINCE


def orphan(tier: str, step: int, me: ThisRank, recorded: bool | None, copy: CopyState) -> EvictCopy | Keep:
    """Whether this rank's unrecorded copy of ``step`` (:func:`unrecorded_copies`) goes, judged when it is
    about to be evicted, from the step's record looked at again (``recorded``; None: it could not be
    read) and what this hierarchy tracks of the copy now.

    It goes when its record is still missing and the copy is either left by a commit that never completed
    (one this hierarchy does not track, or one whose commit failed; one whose outcome is unknown only once
    :func:`still_unknown`), or one this hierarchy committed whose record another process removed,
    evicting the step (the other ranks of its node on a node-local tier, rank 0 or a rank making room on
    a shared one), that no transfer of this rank reads. It stays while this hierarchy writes or evicts it
    (a commit writes the record after the copy), or is about to write it again."""
    if recorded is None:
        return Keep(tier, step, me.rank, "its commit record could not be read")
    if recorded:
        return Keep(tier, step, me.rank, "its commit record is there")
    if copy.state not in (None, "failed", "committed"):
        return Keep(tier, step, me.rank, f"this rank's copy is {copy.state}")
    if copy.unknown:
        return Keep(tier, step, me.rank, "its commit's outcome is unknown")
    if copy.state == "committed" and copy.pinned:
        return Keep(tier, step, me.rank, "a transfer reads it")
    return EvictCopy(tier, step, me.rank)


def lister(me: ThisRank, *, shared: bool, cheap: bool, ranks_meet: bool, nodes_meet: bool) -> int | None:
    """The rank that lists a tier for the ranks that share it, once, when the hierarchy opens (every rank
    then follows the tier through its commits and evictions, and never lists it again): on a tier whose
    listing is not cheap (an object store's LIST costs a request and money, and hundreds of ranks listing
    at once get throttled), in a job of several ranks whose coordinator connects them (``ranks_meet``),
    rank 0 for a shared tier, and for a node-local one the lowest rank of the node, where the coordinator
    has node exchanges (``nodes_meet``) — the rank :func:`sweeps_strays` names. None: each rank lists the
    tier itself (a cheap listing, a rank alone, ranks that decide alone)."""
    if cheap or me.world_size == 1 or not ranks_meet or not (shared or nodes_meet):
        return None
    return 0 if shared else min(me.node_ranks, default=me.rank)


def seen_by(every: TierHoldings, rank: int, versions: Mapping[int, int | None]) -> TierHoldings:
    """What ``every``, a listing of every rank's copies (``every.ranks``) made by :func:`lister`'s rank,
    shows ``rank``: its own copies, the records, the world size of each record of a step without a copy
    of ``rank``, and ``versions``, the format version of each of its copies without a record (read from
    the copy by ``rank``: :func:`own_unrecorded` says which). The same holdings as ``rank``'s own listing
    would have shown at that moment."""
    own = own_steps(every, rank)
    return TierHoldings(
        every.tier,
        own,
        every.records,
        {s: every.record_sizes.get(s) for s in sorted(every.records - own)},
        {s: versions.get(s) for s in sorted(own - every.records)},
    )


def own_steps(every: TierHoldings, rank: int) -> frozenset[int]:
    """The steps of which ``every`` (a listing of every rank's copies) shows a copy of ``rank``."""
    return frozenset(s for s, ranks in (every.ranks or {}).items() if rank in ranks)


def own_unrecorded(every: TierHoldings, rank: int) -> list[int]:
    """The steps of ``rank``'s copies without a record in ``every``, whose format versions :func:`seen_by`
    needs (a copy of format 4 or older is committed by itself)."""
    return sorted(own_steps(every, rank) - every.records)


# -- retention and eviction ----------------------------------------------------------------------------
def rank_evictions(
    evict: Sequence[tuple[str, int]],
    shared: Collection[str],
    world_size: int,
    decided: Sequence[tuple[str, int]] | None,
) -> list[tuple[str, int]]:
    """What this rank evicts of a retention plan's ``evict`` ((tier, step), in order): on a node-local
    tier, its own window; on a shared tier in a job of several ranks, only rank 0's decision sent with a
    commit every rank made (``decided``, see :func:`shared_decision`; None: a pass without one, after a
    promotion, a failed commit or for a full tier, leaves shared tiers to the next commit)."""
    if not shared or world_size == 1:
        return list(evict)
    own = [(n, s) for n, s in evict if n not in shared]
    return own + [(n, s) for n, s in decided or () if n in shared]


def shared_decision(evict: Sequence[tuple[str, int]], shared: Collection[str]) -> list[tuple[str, int]]:
    """Rank 0's decision, made in a commit every rank makes (once every rank's copy is in): what its
    retention plan evicts from shared tiers. Rank 0 removes those steps' records first
    (:func:`eviction` with ``decided``), and every rank then evicts its copy."""
    return [(n, s) for n, s in evict if n in shared]


def removes_record(shared: bool, world_size: int, *, alone: bool = False) -> bool:
    """Whether the rank evicting a step removes the step's record itself: on a node-local tier, yes (each
    rank its own window; idempotent); on a shared tier of a job of several ranks, no (rank 0 removed it
    when it decided), unless the rank evicts ``alone`` to make room on a full tier (the record would
    name a copy that is gone: the step leaves the tier for every rank)."""
    return alone or not shared or world_size == 1


def unowned_ranks(saved_world_size: int, me: ThisRank, shared: bool) -> list[int]:
    """The ranks of the job that saved a step (``saved_world_size`` ranks, as its record says) whose
    copies on a tier no rank of this job evicts as its own: after a world-size change, on a shared tier
    the ranks beyond this job's, on a node-local one the ranks not on this node. None on the same
    world size (a rank placed on another node keeps its old copies: docs/distributed.md)."""
    if saved_world_size == me.world_size:
        return []
    mine = range(me.world_size) if shared else me.node_ranks
    return sorted(set(range(saved_world_size)) - set(mine))


def deciding_eviction(
    tier: str, step: int, me: ThisRank, saved_world_size: int | None
) -> tuple[list[Action], list[int]]:
    """Rank 0's part of a shared tier's eviction it decides (:func:`shared_decision`): the step's record
    goes now, so that the step is unlisted for every rank before any rank evicts its copy; returned with
    it, the ranks whose copies rank 0 evicts with its own once every rank has the decision (those no rank
    of this job owns, :func:`unowned_ranks` of the world size the record named, read before it went)."""
    unowned = unowned_ranks(saved_world_size, me, shared=True) if saved_world_size is not None else []
    return [RemoveRecord(tier, step)], unowned


def eviction(
    tier: str,
    step: int,
    me: ThisRank,
    *,
    shared: bool,
    alone: bool = False,
    saved_world_size: int | None = None,
    unowned: Sequence[int] = (),
) -> list[Action]:
    """How this rank evicts ``step`` from ``tier``: the record first when it removes it
    (:func:`removes_record`: the step is unlisted at once for every rank), then its own copy, then the
    copies of the saving job's ranks no rank of this job owns (:func:`unowned_ranks` of the world size
    the record named, read before it went: ``saved_world_size``; or ``unowned``, decided by rank 0 when
    it removed a shared tier's record), so that an evicted step leaves no copy behind."""
    out: list[Action] = []
    if removes_record(shared, me.world_size, alone=alone):
        out.append(RemoveRecord(tier, step))
        if saved_world_size is not None:
            unowned = unowned_ranks(saved_world_size, me, shared)
    out.append(EvictCopy(tier, step, me.rank))
    out += [EvictCopy(tier, step, r) for r in unowned if r != me.rank]
    return out


def deletion(plans: Sequence[Sequence[Action]]) -> list[Action]:
    """How this rank deletes a step from several tiers at once (``Hierarchy.delete``), from each tier's
    :func:`eviction` plan: every record removal of every plan first, then the copies, each group in the
    plans' order. The step is unlisted on every tier before any copy of it goes, so a deletion cut short
    (a crash, a record that cannot be removed: it stops the plan) leaves either whole committed copies
    or record-less ones (orphans, which the next retention pass removes), never a tier whose record
    names a copy that is gone."""
    records = [a for p in plans for a in p if isinstance(a, RemoveRecord)]
    return records + [a for p in plans for a in p if not isinstance(a, RemoveRecord)]


def sweeps_strays(me: ThisRank, *, shared: bool) -> bool:
    """Whether this rank looks for stray copies (:func:`stray_copies`) on a tier, once a hierarchy (its
    first listing of the tier looks at every rank's copies): rank 0 on a shared tier, the lowest rank of
    its node on a node-local one (the other ranks of a node share its directory)."""
    return me.rank == (0 if shared else min(me.node_ranks, default=me.rank))


def stray_copies(holdings: TierHoldings, me: ThisRank) -> list[EvictCopy]:
    """The copies of ranks beyond this job's world size that no record names, of a listing that looked at
    every rank's copies (``holdings.ranks``; none otherwise): of a step without a record (a larger job
    died before it committed it), or whose record names fewer ranks (``holdings.record_sizes``; a step
    this job saved again). No rank of this job owns them and nothing else ever removes them
    (:func:`sweeps_strays` says which rank looks). The copies a record names are left to the step's
    eviction (:func:`eviction` removes those no rank of this job owns), and so are those of a record
    that cannot be read. A step without a record is a stray's only when its copies are of a format that
    has records (``holdings.step_versions``): one of format 4 or older is committed by itself (as
    :func:`listed_steps` lists it), and one whose version could not be read is kept (what cannot be
    told apart is never deleted). Copies of ranks of this job are never strays, whatever node they are
    on: a node-local directory shared by mistake holds the copies other nodes' ranks are writing."""

    def named(step: int, rank: int) -> bool:
        if step not in holdings.records:
            return not _recorded_format(holdings.step_versions.get(step))
        size = holdings.record_sizes.get(step)
        return size is None or rank < size

    return [
        EvictCopy(holdings.tier, step, r)
        for step, ranks in sorted((holdings.ranks or {}).items())
        for r in sorted(ranks)
        if r >= me.world_size and not named(step, r)
    ]
