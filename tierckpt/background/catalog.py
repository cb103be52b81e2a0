"""What a hierarchy knows about its own copies: per step and tier, the state of each copy, pins, errors,
commit outcomes it could not learn, the tiers each save was sent to, and the demotion cadences
(:class:`Catalog`). Bookkeeping only: what the tiers hold is read by :mod:`tierckpt.background.listing`,
and what it means for the ranks of a job is decided by :mod:`tierckpt.policies.protocol`."""

from __future__ import annotations

import builtins
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.policies.placement import CatalogView, Sent
from tierckpt.policies.protocol import CopyState

if TYPE_CHECKING:
    from tierckpt.tiers.base import Tier

__all__ = ["STATES", "Catalog", "CheckpointInfo"]

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


class Catalog:
    """What one rank's hierarchy knows of its copies: per step and tier the state of each copy it writes,
    their errors, the pins that keep copies from eviction while a transfer reads them, the copies whose
    commit outcome is unknown, the steps each save was sent to, the demotion cadences, and the steps it
    committed on tiers whose listing is not cheap. Thread-safe; ``changed`` is notified on every update
    (the backpressure wait uses it).

    Tiers whose listing is not cheap (``capabilities.cheap_listing`` False: an object store's LIST costs a
    round trip and money) are listed once (:mod:`tierckpt.background.listing`), and then followed here,
    through this hierarchy's own commits and evictions (the tier's lease makes it their only writer).

    Args:
        tiers: the tiers, fastest first.
        rank: this process's rank.
        now: the clock reading the demotion cadences start from.
        world_size: the number of ranks of this job.
    """

    def __init__(self, tiers: Sequence[Tier], rank: int, now: float = 0.0, world_size: int = 1) -> None:
        self.tiers = tuple(tiers)
        self.rank = rank
        self.world_size = world_size
        self.changed = threading.Condition(threading.RLock())
        self._sent = {t.name: Sent(0, now) for t in self.tiers[1:]}
        # tiers whose listing is not cheap: their committed steps (listed once, then followed), and
        # whether that one listing happened (commits made meanwhile are kept, evictions forgotten)
        self._followed: dict[str, builtins.set[int]] = {
            t.name: set() for t in self.tiers if not t.capabilities.cheap_listing
        }
        self._listed: builtins.set[str] = set()
        self._states: dict[int, dict[str, str]] = {}
        self._errors: dict[int, dict[str, BaseException]] = {}
        self._pins: Counter[tuple[int, str]] = Counter()
        self._promoted: builtins.set[tuple[int, str]] = set()
        self._latest: builtins.set[tuple[int, str]] = set()  # the copies of the newest save (in time)
        self._wanted: dict[int, builtins.set[str]] = {}
        # failed copies whose commit's outcome is unknown (rank 0 may have written the record): not
        # orphans until rank 0 publishes a later commit on their tier (policies.protocol.still_unknown)
        self._unknown: builtins.set[tuple[int, str]] = set()

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

    def set(
        self, step: int, tier: str, state: str, error: BaseException | None = None, *, unknown: bool = False
    ) -> None:
        """Record a state; ``failed`` also records ``error``, and with ``unknown`` that the commit's
        outcome is unknown (:func:`~tierckpt.policies.protocol.unknown_outcome` of ``error``). A failed
        tier stays wanted: retention holds the step's slowest copy until that tier has the step or a
        newer one (see ``plan_retention``)."""
        with self.changed:
            self._states.setdefault(step, {})[tier] = state
            if state == "committed" and tier in self._followed:
                self._followed[tier].add(step)
            if state == "failed":
                self._errors.setdefault(step, {})[tier] = error or RuntimeError("failed")
                if unknown:
                    self._unknown.add((step, tier))
            self.changed.notify_all()

    def settle_unknown(self, still: Callable[[builtins.set[tuple[int, str]]], builtins.set[tuple[int, str]]]) -> None:
        """Keep of the copies whose commit outcome is unknown, as (step, tier), those ``still`` returns
        (:func:`~tierckpt.policies.protocol.still_unknown`)."""
        with self.changed:
            self._unknown = still(set(self._unknown))

    def copy_state(self, step: int, tier: str) -> CopyState:
        """What this hierarchy tracks of its copy of ``step`` on ``tier`` now, for the protocol's rules."""
        with self.changed:
            return CopyState(
                self._states.get(step, {}).get(tier), (step, tier) in self._pins, (step, tier) in self._unknown
            )

    def forget(self, step: int, tier: str) -> None:
        """The copy is gone (evicted): drop its state."""
        with self.changed:
            self._states.get(step, {}).pop(tier, None)
            self._promoted.discard((step, tier))
            if tier in self._followed:
                self._followed[tier].discard(step)
            self.changed.notify_all()

    def busy(self, step: int) -> list[str]:
        """What this hierarchy is doing with ``step`` now: each tier whose copy is ``pending``, ``writing``
        or ``evicting``, and each tier whose copy a transfer reads (pinned)."""
        with self.changed:
            moving = [t for t, v in self._states.get(step, {}).items() if v in ("pending", "writing", "evicting")]
            return moving + [f"{t} (read by a copy)" for s, t in self._pins if s == step]

    def wait_idle(self, step: int) -> None:
        """Wait until this hierarchy does nothing with ``step`` (:meth:`busy` is empty): its save, its
        copies up or down the chain and their reads, an eviction of it have ended, each one way or
        another (every change of state notifies; looked at again each second all the same)."""
        with self.changed:
            while self.busy(step):
                self.changed.wait(1.0)

    def drop(self, step: int) -> None:
        """``step`` was deleted: forget everything about it (its states and errors, the tiers it was sent
        to, whether it is the newest save, its unknown outcomes), as if it had never been saved."""
        with self.changed:
            for d in (self._states, self._errors, self._wanted):
                d.pop(step, None)
            self._latest = {(s, t) for s, t in self._latest if s != step}
            self._promoted = {(s, t) for s, t in self._promoted if s != step}
            self._unknown = {(s, t) for s, t in self._unknown if s != step}
            for followed in self._followed.values():
                followed.discard(step)
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

    # -- tiers whose listing is not cheap ---------------------------------------------------------------
    def followed(self, tier: str) -> builtins.set[int] | None:
        """The steps this hierarchy knows committed on ``tier``, a tier it lists only once; None when it
        lists ``tier`` every time, or has not listed it yet."""
        with self.changed:
            return set(self._followed[tier]) if tier in self._listed else None

    def follow(self, tier: str, listed: Iterable[int]) -> builtins.set[int] | None:
        """``tier``'s one listing (``listed``): from now on it is followed through this hierarchy's commits
        and evictions (a step evicted since the listing is evicted again: a no-op). Returns the steps
        followed, or None for a tier that is listed every time."""
        with self.changed:
            if tier not in self._followed:
                return None
            self._followed[tier] |= set(listed)
            self._listed.add(tier)
            return set(self._followed[tier])

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
