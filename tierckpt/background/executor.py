"""The rank executor: carries out the many-rank protocol's plans (:mod:`tierckpt.policies.protocol`).

It decides nothing. For each protocol event of one rank (a commit, its failure, rank 0's decision of a
shared tier's evictions, the eviction of a step, the sweep of record-less copies, a promotion) it reads
what the rule needs from the tiers (:mod:`tierckpt.tiers.holdings`) and the catalog, calls the rule,
carries out the actions it returns in order, and records the outcome in the catalog. An action that
fails does what the rule set in it (:data:`~tierckpt.policies.protocol.OnFailure`): raise, stop the
plan, or go on, with a warning for the last two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from tierckpt.background.catalog import Catalog
from tierckpt.background.listing import Listing
from tierckpt.errors import CheckpointNotFoundError, TierckptError
from tierckpt.format.location import Location
from tierckpt.format.manifest import HEADER, BlobEntry, manifest_version
from tierckpt.format.record import decode_record, encode_record, manifest_tag
from tierckpt.policies.protocol import (
    Action,
    CommitOutcome,
    EvictCopy,
    Fail,
    Keep,
    RemoveRecord,
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
    lone_commit,
    orphan,
    promotion,
    rank_evictions,
    removes_record,
    shared_decision,
    still_unknown,
    stray_copies,
    unknown_outcome,
    unwritten_record_actions,
)
from tierckpt.policies.retention import RetentionPlan
from tierckpt.ranks.commit import Commits, DecisionKeys
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.ranks.nodeplace import node_place
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.holdings import record_world_size, recorded

__all__ = ["RankExecutor"]

log = logging.getLogger(__name__)

Evictions = list[tuple[str, int]]
T = TypeVar("T")


class MakesRoom(Protocol):
    """Runs ``attempt`` (a write of ``step`` on ``tier``), making room on the tier and running it again
    while it is full (:meth:`Mover.with_room <tierckpt.background.mover.Mover.with_room>`)."""

    def __call__(self, tier: Tier, step: int, attempt: Callable[[], T]) -> T: ...


def _as_is(tier: Tier, step: int, attempt: Callable[[], T]) -> T:
    return attempt()


class RankExecutor:
    """Carries out one rank's part of the many-rank protocol (see the module docstring).

    Args:
        tiers: the chain, fastest first.
        catalog: the hierarchy's bookkeeping.
        listing: what this rank lists on its tiers (the hierarchy's; its ``me`` is this rank in its job).
        coordinator: the commits' gathers.
        keys: the hierarchy's decision names.
        room: runs a record's write, making room on a full tier (default: as it is).

    Attributes:
        shared: the names of the shared tiers.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        catalog: Catalog,
        listing: Listing,
        coordinator: Coordinator,
        keys: DecisionKeys,
        room: MakesRoom = _as_is,
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.room = room
        self.catalog = catalog
        self.me = listing.me
        self.commits = Commits(coordinator, keys)
        self.coordinator = coordinator
        self.listing = listing
        self.shared = {t.name for t in tiers if t.capabilities.shared}
        self._unowned: dict[tuple[str, int], list[int]] = {}  # (tier, step): rank 0 evicts them with its own
        self._lock = threading.Lock()

    # -- the commit -------------------------------------------------------------------------------------
    def publish(
        self, tier: Tier, key: CheckpointKey, manifest: bytes, then: Callable[[str, int], Evictions]
    ) -> Evictions | None:
        """Publish this rank's copy of ``key``, committed on ``tier``, once every rank's is (the commit:
        :mod:`tierckpt.ranks.commit`). In a job of several ranks, rank 0 also runs ``then(tier name,
        step)`` once the record is written (its decision of what shared tiers evict, with that step
        committed) and every rank returns it; None for a rank alone. On failure, what the failure leaves
        is removed as the protocol says, then it raises."""
        shared = tier.capabilities.shared
        if commits_alone(self.me):
            outcome, plan = lone_commit(tier.name, shared, key.step, manifest_tag(manifest))
            try:
                self.carry_out(plan, encode_record(outcome.record) if outcome.record else b"")
            except BaseException as e:
                self._failed(tier, key.step, e)
                raise
            self._decided(tier.name)
            return None
        try:
            got = self.commits.gather(tier.name, key.step, manifest_tag(manifest), self._decider(tier, key.step, then))
            outcome = CommitOutcome(key.step, decode_record(got["record"], key.step))
        except BaseException as e:
            self._failed(tier, key.step, e)
            raise
        try:
            self.carry_out(committed_actions(tier.name, shared, outcome), got["record"])
        except Exception as e:  # the step is committed: what other ranks wrote stays
            self.carry_out(unwritten_record_actions(tier.name, key.step, self.me, str(e)))
            raise
        self._decided(tier.name)
        return [(str(n), int(s)) for n, s in got["evict"]]

    def place(self, tier: Tier, key: CheckpointKey, blobs: Sequence[BlobEntry], name: str | None) -> Location:
        """This rank's place for its copy of ``key`` on ``tier`` (a ``node_files`` tier): from its node's
        exchange named ``name``, or a node file of its own (None); see :mod:`tierckpt.ranks.nodeplace`."""
        return node_place(self.coordinator, tier, key, blobs, name, self.room)

    def skip_place(self, tier: Tier, key: CheckpointKey, name: str, error: BaseException) -> None:
        """This rank's copy of ``key`` on ``tier`` failed before its node's exchange ``name``: tell the
        ranks of its node at once (they would wait for it until the timeout). Never raises."""
        fail = getattr(self.coordinator, "node_fail", None)
        if fail is None or commits_alone(self.me):
            return
        try:
            fail(name, f"tier {tier.name!r}: step {key.step}: {type(error).__name__}: {error}")
        except BaseException as e:
            log.debug(
                "step %d on tier %r: the node's exchange could not learn of the failure (%s)", key.step, tier.name, e
            )

    def abandon(self, tier: Tier, key: CheckpointKey) -> None:
        """This rank's copy of ``key`` on ``tier`` failed: tell the other ranks at once (they fail the
        step without waiting for a timeout). Never raises."""
        if commits_alone(self.me):
            return
        try:
            self.commits.gather(tier.name, key.step, None, self._decider(tier, key.step, lambda *_: []))
        except BaseException as e:
            log.debug("step %d on tier %r: the other ranks learned of the failure (%s)", key.step, tier.name, e)
        else:  # pragma: no cover - rank 0 refuses a commit with a failed copy
            log.error("step %d on tier %r: committed although this rank's copy failed", key.step, tier.name)

    def _decider(
        self, tier: Tier, step: int, then: Callable[[str, int], Evictions]
    ) -> Callable[[list[int | None]], dict[str, Any]]:
        """Rank 0's part of the commit, run once every rank's report is in."""

        def decide(tags: list[int | None]) -> dict[str, Any]:
            outcome = decide_commit(step, tags)
            data = encode_record(outcome.record) if outcome.record else b""
            self.carry_out(deciding_actions(tier.name, tier.capabilities.shared, outcome), data)
            if not outcome.committed:
                raise TierckptError(
                    f"step {step} is not committed on tier {tier.name!r}: the copies of ranks {list(outcome.failed)} failed"
                )
            evict: Evictions = []
            try:
                evict = then(tier.name, step)
            except Exception as e:  # retention problems are logged, never fail a commit
                log.warning("retention decided with step %d on tier %r failed: %s", step, tier.name, e)
            return {"record": data, "evict": [[n, s] for n, s in evict]}

        return decide

    def _failed(self, tier: Tier, step: int, error: BaseException) -> None:
        undecided = unknown_outcome(error)
        plan = failed_commit_actions(
            tier.name, tier.capabilities.shared, step, self.me, undecided=undecided, why=str(error)
        )
        self.carry_out(plan)

    def _decided(self, tier: str) -> None:
        """Rank 0 published a commit on ``tier``."""
        self.catalog.settle_unknown(lambda unknown: still_unknown(unknown, tier, published=True))

    def promote(self, src: Tier, dst: Tier, step: int, manifest: bytes) -> None:
        """This rank's copy of ``step`` (its manifest ``manifest``) was copied from ``src`` up to ``dst``:
        give it what :func:`~tierckpt.policies.protocol.promotion` says (the step's record from ``src``).

        Raises:
            CheckpointNotFoundError: ``src`` lost the step's record meanwhile (the promoted copy went).
        """
        record = src.read_record(step)
        version = manifest_version(manifest[: HEADER.size])
        plan = promotion(dst.name, step, self.me, recorded=record is not None, version=version)
        self.carry_out(plan, record or b"")

    # -- retention ----------------------------------------------------------------------------------------
    def agree(self, plan: RetentionPlan, decided: Evictions | None) -> RetentionPlan:
        """``plan`` with its evictions as this rank makes them (:func:`~tierckpt.policies.protocol.rank_evictions`:
        on shared tiers, rank 0's decision ``decided``, or none)."""
        return RetentionPlan(rank_evictions(plan.evict, self.shared, self.me.world_size, decided), plan.held)

    def decide_shared(self, evict: Evictions) -> Evictions:
        """Rank 0, in a commit every rank makes: of its retention plan's ``evict``, the shared tiers' steps
        (:func:`~tierckpt.policies.protocol.shared_decision`), their records removed already (every rank
        then evicts its copy); those whose record could not be removed are left for later."""
        done = []
        for name, step in shared_decision(evict, self.shared):
            actions, unowned = deciding_eviction(name, step, self.me, record_world_size(self.tiers[name], step))
            if not self.carry_out(actions):
                continue
            with self._lock:
                self._unowned[(name, step)] = unowned  # evicted with rank 0's own copy, once every rank knows
            done.append((name, step))
        return done

    def evict(self, tier: Tier, step: int, free: bool = True, *, alone: bool = False) -> None:
        """Evict ``step`` from ``tier`` as :func:`~tierckpt.policies.protocol.eviction` says (``alone``: to
        make room on a full tier, without rank 0's decision); the catalog forgets the copy once it is
        gone, or has it committed again when it could not go."""
        done = self.carry_out(self._eviction(tier, step, alone), free=free)
        self._evicted(tier, step, done)

    def delete(self, tiers: Sequence[Tier], step: int, free: bool = True) -> None:
        """Evict ``step`` from each of ``tiers`` at once (``Hierarchy.delete``): each tier's
        :func:`~tierckpt.policies.protocol.eviction`, every record first
        (:func:`~tierckpt.policies.protocol.deletion`); on a shared tier in a job of several ranks, rank
        0 removed the record already (:meth:`decide_shared`). A copy that cannot go is left unlisted to a
        later retention pass, as an eviction's is.

        Raises:
            TierckptError: a record could not be removed (naming the tiers whose copies stay).
        """
        plan = deletion([self._eviction(t, step) for t in tiers])
        done = self.carry_out(plan, free=free)
        for t in tiers:
            self._evicted(t, step, done)
        kept = [a.tier for a in plan if isinstance(a, RemoveRecord) and a not in done]
        if kept:
            raise TierckptError(
                f"step {step} is still committed on tiers {kept}: its commit record there could not be removed "
                "(see the warning); its copies there stay whole, and delete() may be called again"
            )

    def _eviction(self, tier: Tier, step: int, alone: bool = False) -> list[Action]:
        """The protocol's plan to evict ``step`` from ``tier`` (the copy marked ``evicting`` meanwhile)."""
        self.catalog.set(step, tier.name, "evicting")
        shared = tier.name in self.shared
        with self._lock:
            unowned = self._unowned.pop((tier.name, step), [])
        saved = None
        if removes_record(shared, self.me.world_size, alone=alone):
            saved = record_world_size(tier, step)  # read before the record goes: the ranks it names
        return eviction(tier.name, step, self.me, shared=shared, alone=alone, saved_world_size=saved, unowned=unowned)

    def _evicted(self, tier: Tier, step: int, done: Sequence[Action]) -> None:
        """The catalog forgets this rank's copy of ``step`` on ``tier`` once ``done`` evicted it, or has it
        committed again when it could not go (the carrying out said why)."""
        if EvictCopy(tier.name, step, self.me.rank) in done:
            self.catalog.forget(step, tier.name)
            self.listing.forget(step, tier.name)
        else:
            self.catalog.set(step, tier.name, "committed")

    def sweep(self) -> None:
        """Evict this rank's copies the last listings showed without a record that the protocol says are
        orphans (:func:`~tierckpt.policies.protocol.orphan`, judged now: the record looked at again, the
        copy's state as it is now), and the stray copies of ranks beyond this job a listing of every
        rank's copies showed (:func:`~tierckpt.policies.protocol.stray_copies`)."""
        for step, name in self.listing.unrecorded():
            tier = self.tiers[name]
            verdict = orphan(name, step, self.me, recorded(tier, step), self.catalog.copy_state(step, name))
            if isinstance(verdict, EvictCopy):
                log.info("step %d on tier %r has no commit record (never committed by every rank, or evicted by "
                         "another rank): removing this rank's copy", step, name)  # fmt: skip
            self.carry_out([verdict])
        for holdings in self.listing.every_rank():
            strays = stray_copies(holdings, self.me)
            if strays:
                log.info("tier %r: removing the copies of ranks beyond this job's %d of uncommitted steps: %s",
                         holdings.tier, self.me.world_size, [(a.step, a.rank) for a in strays])  # fmt: skip
            self.carry_out(strays)

    # -- carrying a plan out --------------------------------------------------------------------------------
    def carry_out(self, plan: Sequence[Action], record: bytes = b"", free: bool = True) -> list[Action]:
        """Carry ``plan`` out in order, each failure as its action says (see the module docstring); the
        actions done."""
        done: list[Action] = []
        for a in plan:
            if isinstance(a, Warn):
                log.warning("%s", a.message)
            elif isinstance(a, Keep):
                log.debug("step %d on tier %r: rank %d's copy stays: %s", a.step, a.tier, a.rank, a.why)
            elif isinstance(a, Fail):
                raise CheckpointNotFoundError(a.why)
            else:
                try:
                    self._do(a, record, free)
                except Exception as e:
                    if a.on_failure == "raise":
                        raise
                    log.warning("step %d on tier %r: cannot %s: %s", a.step, a.tier, _what(a), e)
                    if a.on_failure == "stop":
                        return done
                    continue
            done.append(a)
        return done

    def _do(self, a: WriteRecord | RemoveRecord | EvictCopy, record: bytes, free: bool) -> None:
        tier = self.tiers[a.tier]
        if isinstance(a, WriteRecord):
            self.room(tier, a.step, lambda: tier.write_record(a.step, record))
        elif isinstance(a, RemoveRecord):
            tier.remove_record(a.step)
        else:
            tier.evict(CheckpointKey(a.step, a.rank), free=free)


def _what(a: WriteRecord | RemoveRecord | EvictCopy) -> str:
    """What ``a`` does, for messages."""
    if isinstance(a, EvictCopy):
        return f"evict rank {a.rank}'s copy"
    return f"{'write' if isinstance(a, WriteRecord) else 'remove'} its commit record"
