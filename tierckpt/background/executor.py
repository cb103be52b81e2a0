"""The rank executor: carries out the many-rank protocol's plans (:mod:`tierckpt.policies.protocol`).

It decides nothing. For each protocol event of one rank (a commit, its failure, rank 0's decision of a
shared tier's evictions, the eviction of a step, the sweep of record-less copies) it reads what the rule
needs from the tiers (:mod:`tierckpt.tiers.holdings`) and the catalog, calls the rule, carries out the
actions it returns in order, and records the outcome in the catalog. Carrying a plan out: a record that
cannot be written raises (the commit fails); a record that cannot be removed stops the plan (the copies
it names stay, so a record never names a copy that is gone), with a warning; a copy that cannot be
evicted is a warning, and the plan goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tierckpt.background.catalog import Catalog
from tierckpt.background.listing import Listing
from tierckpt.errors import CoordinationError, TierckptError
from tierckpt.format.record import decode_record, encode_record, manifest_tag
from tierckpt.policies.protocol import (
    Action,
    CommitOutcome,
    EvictCopy,
    Keep,
    RemoveRecord,
    Warn,
    WriteRecord,
    committed_actions,
    decide_commit,
    deciding_actions,
    deciding_eviction,
    eviction,
    failed_commit_actions,
    orphan,
    rank_evictions,
    removes_record,
    shared_decision,
    still_unknown,
    stray_copies,
)
from tierckpt.policies.retention import RetentionPlan
from tierckpt.ranks.commit import Commits, DecisionKeys
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.holdings import record_world_size, recorded

__all__ = ["RankExecutor"]

log = logging.getLogger(__name__)

Evictions = list[tuple[str, int]]


class RankExecutor:
    """Carries out one rank's part of the many-rank protocol (see the module docstring).

    Args:
        tiers: the chain, fastest first.
        catalog: the hierarchy's bookkeeping.
        listing: what this rank lists on its tiers (the hierarchy's; its ``me`` is this rank in its job).
        coordinator: the commits' gathers.
        keys: the hierarchy's decision names.

    Attributes:
        shared: the names of the shared tiers.
    """

    def __init__(
        self, tiers: Sequence[Tier], catalog: Catalog, listing: Listing, coordinator: Coordinator, keys: DecisionKeys
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.catalog = catalog
        self.me = listing.me
        self.commits = Commits(coordinator, keys)
        self.listing = listing
        self.shared = {t.name for t in tiers if t.capabilities.shared}
        self._unowned: dict[tuple[str, int], list[int]] = {}  # (tier, step): rank 0 evicts them with its own
        self._lock = threading.Lock()

    # -- the commit -------------------------------------------------------------------------------------
    def publish(
        self, tier: Tier, key: CheckpointKey, manifest: bytes, then: Callable[[], Evictions]
    ) -> Evictions | None:
        """Publish this rank's copy of ``key``, committed on ``tier``, once every rank's is (the commit:
        :mod:`tierckpt.ranks.commit`). In a job of several ranks, rank 0 also runs ``then()`` once the
        record is written (its decision of what shared tiers evict) and every rank returns it; None for a
        rank alone. On failure, what the failure leaves is removed as the protocol says, then it raises."""
        shared = tier.capabilities.shared
        if self.me.world_size == 1:
            outcome = decide_commit(key.step, [manifest_tag(manifest)])
            data = encode_record(outcome.record) if outcome.record else b""
            try:
                self._carry_out(
                    deciding_actions(tier.name, shared, outcome) + committed_actions(tier.name, shared, outcome), data
                )
            except BaseException as e:
                self._failed(tier, key.step, e)
                raise
            self._decided(tier.name)
            return None
        try:
            got = self.commits.gather(tier.name, key.step, manifest_tag(manifest), self._decider(tier, key.step, then))
            outcome = CommitOutcome(key.step, decode_record(got["record"], key.step))
            self._carry_out(committed_actions(tier.name, shared, outcome), got["record"])
        except BaseException as e:
            self._failed(tier, key.step, e)
            raise
        self._decided(tier.name)
        return [(str(n), int(s)) for n, s in got["evict"]]

    def abandon(self, tier: Tier, key: CheckpointKey) -> None:
        """This rank's copy of ``key`` on ``tier`` failed: tell the other ranks at once (they fail the
        step without waiting for a timeout). Never raises."""
        if self.me.world_size == 1:
            return
        try:
            self.commits.gather(tier.name, key.step, None, self._decider(tier, key.step, list))
        except BaseException as e:
            log.debug("step %d on tier %r: the other ranks learned of the failure (%s)", key.step, tier.name, e)
        else:  # pragma: no cover - rank 0 refuses a commit with a failed copy
            log.error("step %d on tier %r: committed although this rank's copy failed", key.step, tier.name)

    def _decider(
        self, tier: Tier, step: int, then: Callable[[], Evictions]
    ) -> Callable[[list[int | None]], dict[str, Any]]:
        """Rank 0's part of the commit, run once every rank's report is in."""

        def decide(tags: list[int | None]) -> dict[str, Any]:
            outcome = decide_commit(step, tags)
            data = encode_record(outcome.record) if outcome.record else b""
            self._carry_out(deciding_actions(tier.name, tier.capabilities.shared, outcome), data)
            if not outcome.committed:
                raise TierckptError(
                    f"step {step} is not committed on tier {tier.name!r}: the copies of ranks {list(outcome.failed)} failed"
                )
            evict: Evictions = []
            try:
                evict = then()
            except Exception as e:  # retention problems are logged, never fail a commit
                log.warning("retention decided with step %d on tier %r failed: %s", step, tier.name, e)
            return {"record": data, "evict": [[n, s] for n, s in evict]}

        return decide

    def _failed(self, tier: Tier, step: int, error: BaseException) -> None:
        undecided = isinstance(error, CoordinationError) and error.undecided
        plan = failed_commit_actions(
            tier.name, tier.capabilities.shared, step, self.me, undecided=undecided, why=str(error)
        )
        self._carry_out(plan)

    def _decided(self, tier: str) -> None:
        """Rank 0 published a commit on ``tier``."""
        self.catalog.settle_unknown(lambda unknown: still_unknown(unknown, tier, published=True))

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
            if not self._carry_out(actions):
                continue
            with self._lock:
                self._unowned[(name, step)] = unowned  # evicted with rank 0's own copy, once every rank knows
            done.append((name, step))
        return done

    def evict(self, tier: Tier, step: int, free: bool = True, *, alone: bool = False) -> None:
        """Evict ``step`` from ``tier`` as :func:`~tierckpt.policies.protocol.eviction` says (``alone``: to
        make room on a full tier, without rank 0's decision); the catalog forgets the copy once it is
        gone, or has it committed again when it could not go."""
        self.catalog.set(step, tier.name, "evicting")
        shared = tier.name in self.shared
        with self._lock:
            unowned = self._unowned.pop((tier.name, step), [])
        saved = None
        if removes_record(shared, self.me.world_size, alone=alone):
            saved = record_world_size(tier, step)  # read before the record goes: the ranks it names
        plan = eviction(tier.name, step, self.me, shared=shared, alone=alone, saved_world_size=saved, unowned=unowned)
        done = self._carry_out(plan, free=free)
        if EvictCopy(tier.name, step, self.me.rank) in done:
            self.catalog.forget(step, tier.name)
            self.listing.forget(step, tier.name)
        else:  # the carrying out said why
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
            self._carry_out([verdict])
        for holdings in self.listing.every_rank():
            strays = stray_copies(holdings, self.me)
            if strays:
                log.info("tier %r: removing the copies of ranks beyond this job's %d of uncommitted steps: %s",
                         holdings.tier, self.me.world_size, [(a.step, a.rank) for a in strays])  # fmt: skip
            self._carry_out(strays)

    # -- carrying a plan out --------------------------------------------------------------------------------
    def _carry_out(self, plan: Sequence[Action], record: bytes = b"", free: bool = True) -> list[Action]:
        """Carry ``plan`` out in order (see the module docstring); the actions done."""
        done: list[Action] = []
        for a in plan:
            if isinstance(a, Warn):
                log.warning("%s", a.message)
            elif isinstance(a, Keep):
                log.debug("step %d on tier %r: rank %d's copy stays: %s", a.step, a.tier, a.rank, a.why)
            elif isinstance(a, WriteRecord):
                self.tiers[a.tier].write_record(a.step, record)
            elif isinstance(a, RemoveRecord):
                try:
                    self.tiers[a.tier].remove_record(a.step)
                except Exception as e:
                    log.warning("step %d on tier %r: cannot remove its commit record: %s", a.step, a.tier, e)
                    return done
            else:
                try:
                    self.tiers[a.tier].evict(CheckpointKey(a.step, a.rank), free=free)
                except Exception as e:
                    log.warning("step %d on tier %r: cannot evict rank %d's copy: %s", a.step, a.tier, a.rank, e)
                    continue
            done.append(a)
        return done
