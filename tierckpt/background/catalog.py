"""What a hierarchy knows about its checkpoints: per step and tier, the state of each copy, pins,
errors, the tiers each save was sent to, and what the tiers hold (:class:`Catalog`)."""

from __future__ import annotations

import builtins
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.errors import CheckpointNotFoundError, CoordinationError, CorruptCheckpointError
from tierckpt.format.manifest import HEADER, MAGIC
from tierckpt.format.record import RECORDS_SINCE, decode_record
from tierckpt.policies.placement import CatalogView, Sent
from tierckpt.tiers.base import CheckpointKey

if TYPE_CHECKING:
    from tierckpt.tiers.base import Tier

__all__ = ["STATES", "Catalog", "CheckpointInfo"]

log = logging.getLogger("tierckpt.hierarchy")

#: States of one step on one tier, in the order a copy goes through them (``absent``: no copy, none coming).
STATES = ("pending", "writing", "committed", "failed", "evicting", "absent")


@dataclass(frozen=True)
class CheckpointInfo:
    """One step as the hierarchy sees it.

    Attributes:
        step: the step.
        tiers: names of the tiers where it is committed, fastest first.
        states: per tier (every tier of the hierarchy, fastest first), one of :data:`STATES`.
        errors: per tier whose copy failed, the error.
    """

    step: int
    tiers: tuple[str, ...]
    states: Mapping[str, str] = field(default_factory=dict)
    errors: Mapping[str, BaseException] = field(default_factory=dict)


def _state(tracked: str, listed: bool) -> str:
    """A copy's state from what this hierarchy tracked and whether its tier lists it as committed."""
    if listed and tracked != "evicting":
        return "committed"
    return "absent" if tracked == "committed" else tracked  # committed but unlisted: evicted from outside


class Catalog:
    """What one rank's hierarchy knows of its copies: per step and tier the state of each copy it writes,
    their errors, the pins that keep copies from eviction while a transfer reads them, the steps each
    save was sent to, the demotion cadences, and what each tier holds. Thread-safe; ``changed`` is
    notified on every update (the backpressure wait uses it).

    What a tier holds is listed from the tier itself, except on tiers whose listing is not cheap
    (``capabilities.cheap_listing`` False: an object store's LIST costs a round trip and money): those are
    listed once, and then followed through this catalog's own commits and evictions (the tier's lease
    makes this hierarchy its only writer).

    Args:
        tiers: the tiers, fastest first.
        rank: this process's rank (only its keys are listed).
        now: the clock reading the demotion cadences start from.
        world_size: the number of ranks of this job (a step saved by another number of ranks is listed
            where its record is, whether or not this rank saved a copy: a restore reshards it).
    """

    def __init__(self, tiers: Sequence[Tier], rank: int, now: float = 0.0, world_size: int = 1) -> None:
        self.tiers = tuple(tiers)
        self.rank = rank
        self.world_size = world_size
        self.changed = threading.Condition(threading.RLock())
        self._sent = {t.name: Sent(0, now) for t in self.tiers[1:]}
        self._newest: int | None = None  # newest step committed or saved (listed at the first save)
        self._warned_order = False
        # tiers whose listing is not cheap: their committed steps (listed once, then followed), and
        # whether that one listing happened (commits made meanwhile are kept, evictions forgotten)
        self._cached: dict[str, builtins.set[int]] = {
            t.name: set() for t in self.tiers if not t.capabilities.cheap_listing
        }
        self._listed: builtins.set[str] = set()
        self._states: dict[int, dict[str, str]] = {}
        self._errors: dict[int, dict[str, BaseException]] = {}
        self._pins: Counter[tuple[int, str]] = Counter()
        self._promoted: builtins.set[tuple[int, str]] = set()
        self._latest: builtins.set[tuple[int, str]] = set()  # the copies of the newest save (in time)
        self._wanted: dict[int, builtins.set[str]] = {}
        self._orphans: builtins.set[tuple[int, str]] = set()
        # failed copies whose commit's outcome is unknown (rank 0 may have written the record): not
        # orphans until the next commit on their tier has an outcome (rank 0 is back, or gone for good)
        self._undecided: builtins.set[tuple[int, str]] = set()
        self._legacy_copies: builtins.set[tuple[int, str]] = set()
        self._record_sizes: dict[tuple[int, str], int] = {}  # (step, tier): ranks its record names

    def plan(self, step: int, tiers: Iterable[str]) -> None:
        """A save or promotion of ``step`` will go to ``tiers``: they become ``pending``; for a step saved by
        this hierarchy (see :meth:`saved`) they also become wanted."""
        with self.changed:
            st = self._states.setdefault(step, {})
            for t in tiers:
                st[t] = "pending"
                self._errors.get(step, {}).pop(t, None)
                if step in self._wanted:
                    self._wanted[step].add(t)
            self.changed.notify_all()

    def set(self, step: int, tier: str, state: str, error: BaseException | None = None) -> None:
        """Record a state; ``failed`` also records ``error``. A failed tier stays wanted: retention holds the
        step's slowest copy until that tier has the step or a newer one (see ``plan_retention``)."""
        with self.changed:
            self._states.setdefault(step, {})[tier] = state
            if state == "committed" and tier in self._cached:
                self._cached[tier].add(step)
            if state == "writing":
                self._legacy_copies.discard((step, tier))
            if state == "failed":
                self._errors.setdefault(step, {})[tier] = error or RuntimeError("failed")
            if state == "failed" and isinstance(error, CoordinationError) and error.undecided:
                self._undecided.add((step, tier))
            self.changed.notify_all()

    def decided(self, tier: str) -> None:
        """A later commit on ``tier`` was published by rank 0: rank 0 (which decides a tier's commits in
        order, on that tier's worker) is past every earlier decision there, so a copy whose outcome was
        unknown now has its record, or never will (an orphan). Nothing else proves it: not a local
        failure, a promotion, nor a commit that failed because rank 0 did not answer (it may still be
        writing the earlier record)."""
        with self.changed:
            self._undecided = {(s, t) for s, t in self._undecided if t != tier}

    def forget(self, step: int, tier: str) -> None:
        """The copy is gone (evicted): drop its state."""
        with self.changed:
            self._record_sizes.pop((step, tier), None)
            self._states.get(step, {}).pop(tier, None)
            self._promoted.discard((step, tier))
            if tier in self._cached:
                self._cached[tier].discard(step)
            self.changed.notify_all()

    def states(self) -> dict[int, dict[str, str]]:
        with self.changed:
            return {s: dict(d) for s, d in self._states.items()}

    def errors(self) -> dict[int, dict[str, BaseException]]:
        with self.changed:
            return {s: dict(d) for s, d in self._errors.items()}

    def wanted(self) -> dict[int, builtins.set[str]]:
        """Per step saved by this hierarchy, the tiers the policy sent it to (failed ones included)."""
        with self.changed:
            return {s: set(d) for s, d in self._wanted.items()}

    def pin(self, step: int, tier: str) -> None:
        with self.changed:
            self._pins[(step, tier)] += 1

    def unpin(self, step: int, tier: str) -> None:
        with self.changed:
            self._pins[(step, tier)] -= 1
            if self._pins[(step, tier)] <= 0:
                del self._pins[(step, tier)]
            self.changed.notify_all()

    def promoted(self, step: int, tier: str, on: bool) -> None:
        """Mark a promoted copy: retention leaves it alone until a newer save commits on that tier."""
        with self.changed:
            (self._promoted.add if on else self._promoted.discard)((step, tier))

    def clear_promoted(self, tier: str, below: int) -> None:
        """A save of a newer step committed on ``tier``: its promoted older copies fall back under retention."""
        with self.changed:
            self._promoted = {(s, t) for s, t in self._promoted if t != tier or s >= below}

    def saved(self, step: int, tiers: Iterable[str]) -> None:
        """``step`` is the newest save (in time): retention keeps its copies even where its number is
        below the ``keep`` window (a job that went back to an older step keeps what it saves). ``tiers``
        become the step's wanted tiers (a step saved again is wanted where this save sends it)."""
        with self.changed:
            names = set(tiers)
            self._latest = {(step, t) for t in names}
            self._wanted[step] = names

    def protected(self) -> builtins.set[tuple[int, str]]:
        """Copies retention must not evict now: pinned by a transfer, freshly promoted, or of the newest
        save."""
        with self.changed:
            return set(self._pins) | self._promoted | self._latest

    def pinned_on(self, tier: str) -> builtins.set[int]:
        with self.changed:
            return {s for s, t in self._pins if t == tier}

    def prune(self, alive: builtins.set[int]) -> None:
        """Forget steps held by no tier that no transfer is working on (keeps memory bounded)."""
        newest = max(alive, default=-1)
        with self.changed:
            for s in list(self._states):
                if s in alive or s >= newest:
                    continue
                if any(v in ("pending", "writing", "evicting") for v in self._states[s].values()):
                    continue
                if any(p == s for p, _ in self._pins):
                    continue
                self._states.pop(s, None)
                self._errors.pop(s, None)
                self._wanted.pop(s, None)

    # -- what the tiers hold --------------------------------------------------------------------------
    def committed(self, tier: Tier) -> list[int]:
        """The steps of this rank committed on ``tier``, oldest first ([] with a warning when it cannot list)."""
        with self.changed:
            if tier.name in self._listed:
                return sorted(self._cached[tier.name])
        steps = self._list(tier)
        if steps is None:
            return []
        with self.changed:
            if tier.name in self._cached:  # a step evicted since the listing is evicted again: a no-op
                self._cached[tier.name] |= set(steps)
                self._listed.add(tier.name)
                return sorted(self._cached[tier.name])
        return steps

    def _list(self, tier: Tier) -> list[int] | None:
        """This rank's committed steps as ``tier`` lists them now: its copies of the steps whose commit
        record the tier holds (docs/distributed.md), and copies written before records existed (format
        version 4 and older). A copy of a later version without its step's record is not committed: a
        commit in progress, or one that never completed (an orphan, see :meth:`orphans`). None (with a
        warning) when the tier cannot list."""
        try:
            own = [k.step for k in tier.list_committed(self.rank) if k.rank == self.rank]
            records = set(tier.list_records())
        except OSError as e:
            log.warning("tier %r cannot list its checkpoints: %s", tier.name, e)
            return None
        out = [s for s in records - set(own) if self._saved_by_others(tier, s)]
        for step in own:
            if step in records or self._legacy(tier, step):
                out.append(step)
            elif self._orphaned(tier, step):
                with self.changed:
                    self._orphans.add((step, tier.name))
        return sorted(out)

    def _saved_by_others(self, tier: Tier, step: int) -> bool:
        """Whether ``step``, recorded on ``tier`` without a copy of this rank, was saved by a job of
        another number of ranks (this rank restores it by resharding: its parts are other ranks'
        copies). The record's world size is read once a step and tier."""
        key = (step, tier.name)
        if key not in self._record_sizes:
            try:
                data = tier.read_record(step)
                size = decode_record(data, step).world_size if data is not None else None
            except (OSError, CorruptCheckpointError):
                size = None  # unreadable: not listed here (a restore of it would say why)
            if size is None:
                return False
            with self.changed:
                self._record_sizes[key] = size
        return self._record_sizes[key] != self.world_size

    def _orphaned(self, tier: Tier, step: int) -> bool:
        """Whether this rank's record-less copy of ``step`` is to be removed, its record still missing when
        looked at again: a copy left by a commit that never completed (one this hierarchy does not track,
        or one whose commit failed; one whose outcome is unknown, only once a later commit on its tier
        has had one: rank 0 may have been writing its record), or a copy this hierarchy committed whose
        record another process removed, evicting the step (the other ranks of its node on a node-local
        tier, rank 0 on a shared one), that no transfer of this rank is reading. Not one it is writing or
        evicting (a commit writes the record between the listing and now)."""
        with self.changed:
            state = self._states.get(step, {}).get(tier.name, "failed")
            if state not in ("failed", "committed") or (step, tier.name) in self._undecided:
                return False
            if state == "committed" and (step, tier.name) in self._pins:
                return False
        try:
            return tier.read_record(step) is None
        except OSError:
            return False

    def _legacy(self, tier: Tier, step: int) -> bool:
        """Whether this rank's copy of ``step`` on ``tier`` predates commit records (remembered: it
        stays so until this hierarchy writes the step again)."""
        if (step, tier.name) in self._legacy_copies:
            return True
        try:
            head = tier.read_manifest(CheckpointKey(step, self.rank))[: HEADER.size]
        except OSError:
            return False  # gone meanwhile, or unreadable: a restore would say why
        if len(head) < HEADER.size or head[:8] != MAGIC:
            return False
        legacy = bool(HEADER.unpack(head)[1] < RECORDS_SINCE)
        if legacy:
            with self.changed:
                self._legacy_copies.add((step, tier.name))
        return legacy

    def orphans(self) -> list[tuple[int, str]]:
        """This rank's copies that were listed without their step's commit record and that this
        hierarchy is not writing, reading or evicting: left by a commit that never completed (a rank
        died, a process was killed between its copy and the record), or unlisted by another rank's
        eviction of the step (see :meth:`_orphaned`); the mover evicts them."""
        with self.changed:
            out, self._orphans = sorted(self._orphans), set()
        return out

    def committed_all(self) -> dict[str, list[int]]:
        """:meth:`committed` of every tier, fastest first."""
        return {t.name: self.committed(t) for t in self.tiers}

    def listing(self) -> list[CheckpointInfo]:
        """This rank's steps, oldest first: what the tiers list as committed (always listed afresh: other
        processes may evict or remove copies) merged with the states of the copies in flight. A tier that
        cannot list (e.g. its directory is gone) is logged and skipped."""
        committed: dict[int, list[str]] = {}
        for t in self.tiers:
            for step in self._list(t) or ():
                committed.setdefault(step, []).append(t.name)
        tracked, errors = self.states(), self.errors()
        out = []
        for s in sorted(set(committed) | set(tracked)):
            here = committed.get(s, [])
            states = {t.name: _state(tracked.get(s, {}).get(t.name, "absent"), t.name in here) for t in self.tiers}
            if any(v != "absent" for v in states.values()):
                out.append(CheckpointInfo(s, tuple(here), states, dict(errors.get(s, {}))))
        return out

    def committed_steps(self, tier: str | None = None) -> list[CheckpointInfo]:
        """Committed steps, oldest first (only those on ``tier``, as held there, if given)."""
        infos = [i for i in self.listing() if i.tiers]
        if tier is not None:
            infos = [CheckpointInfo(i.step, (tier,)) for i in infos if tier in i.tiers]
        return infos

    def locate(self, step: int | None, tier: str | None = None) -> CheckpointInfo:
        """``step`` (None: the newest) as committed (on ``tier`` if given); CheckpointNotFoundError if it is not."""
        infos = self.committed_steps(tier)
        if not infos:
            where = f"tier {tier!r}" if tier else "any tier"
            raise CheckpointNotFoundError(f"no committed checkpoint for rank {self.rank} on {where}")
        if step is None:
            return infos[-1]
        for i in infos:
            if i.step == step:
                return i
        raise CheckpointNotFoundError(f"step {step} is not committed (committed steps: {[i.step for i in infos]})")

    def newest_step(self) -> int:
        """The newest step committed anywhere or saved by this hierarchy (-1: none): the tiers are listed
        once, at the first call, and :meth:`saw_step` keeps it up to date after that."""
        if self._newest is None:
            newest = max((i.step for i in self.committed_steps()), default=-1)
            with self.changed:
                self._newest = newest if self._newest is None else max(self._newest, newest)
        return self._newest

    def saw_step(self, step: int) -> None:
        """A save of ``step`` was made. Warns once when it is older than one already committed:
        ``restore()`` without a step still picks the newer one (a job that went back to an older step
        should remove the steps it abandoned, or restore by step)."""
        newest = self.newest_step()
        if step < newest and not self._warned_order:
            self._warned_order = True
            log.warning(
                "saving step %d, older than step %d already saved: restore() without a step picks step %d; "
                "keep: windows count steps by number (this save is kept until a later save replaces it)",
                step, newest, newest,
            )  # fmt: skip
        with self.changed:
            self._newest = max(newest, step)

    # -- what placement reads -------------------------------------------------------------------------
    def view(
        self, committed: Mapping[str, Sequence[int]] | None = None, held: Iterable[tuple[int, str]] = ()
    ) -> CatalogView:
        """A snapshot for :func:`~tierckpt.policies.place` (``committed``: per tier, when already listed)."""
        with self.changed:
            return CatalogView(
                committed=dict(committed) if committed is not None else {},
                wanted=self.wanted(),
                protected=self.protected(),
                pinned=set(self._pins),
                held=set(held),
                sent=dict(self._sent),
            )

    def set_sent(self, sent: Mapping[str, Sent]) -> None:
        """The demotion cadences after a save (its plan's)."""
        with self.changed:
            self._sent.update(sent)
