"""Placement: what moves where, decided in one pure function, :func:`place`.

Every decision about copies is made here, from data, with no I/O: the hierarchy describes the event
(a save, a prefetch, a close, a retention pass, a full tier) and what its catalog knows, and gets back a
plan; the mover executes plans and decides nothing. That is the seam where a multi-rank job makes a
decision once (rank 0 places, every rank follows the plan it receives).

=====================  ===================================================================
event                  plan
=====================  ===================================================================
:class:`Save`          :class:`SavePlan`: the destination tiers, each copy's sources in order
:class:`Prefetch`      :class:`CopyPlan`: the fill order up the chain
:class:`Restored`      :class:`CopyPlan`: the promotion after a restore (``promote_on_restore``)
:class:`Close`         :class:`CopyPlan`: the ``on_close`` copies of the newest step
:class:`Retain`        :class:`~tierckpt.policies.retention.RetentionPlan`: evictions and held copies
:class:`MakeRoom`      :class:`RoomPlan`: the victim of a full capacity or device, or wait, or fail
=====================  ===================================================================
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from tierckpt.policies.demotion import AnyOf, Cadence, Demotion, Every, Never
from tierckpt.policies.retention import (
    KeepAll,
    KeepLatest,
    RetentionPlan,
    RetentionPolicy,
    capacity_victims,
    plan_retention,
)

if TYPE_CHECKING:
    from tierckpt.config import PolicyConfig

__all__ = [
    "CatalogView",
    "Close",
    "Copy",
    "CopyPlan",
    "MakeRoom",
    "Policy",
    "Prefetch",
    "Restored",
    "Retain",
    "RoomPlan",
    "Save",
    "SavePlan",
    "Sent",
    "place",
]

ON_FULL = ("wait", "fail")


@dataclass(frozen=True)
class Policy:
    """The whole placement policy of a hierarchy.

    Attributes:
        tiers: the tier names, fastest first.
        demotion: per tier below the top, when saves go there (absent: every save).
        retention: per tier, which copies it keeps (absent: all).
        on_full: per tier, ``wait`` (backpressure, the default) or ``fail`` when it is full and nothing
            can be evicted yet.
        promote_on_restore: a restore read from a lower tier copies the step to the top tier.
    """

    tiers: tuple[str, ...]
    demotion: Mapping[str, Demotion] = field(default_factory=dict)
    retention: Mapping[str, RetentionPolicy] = field(default_factory=dict)
    on_full: Mapping[str, str] = field(default_factory=dict)
    promote_on_restore: bool = False

    @classmethod
    def from_config(
        cls,
        tiers: Sequence[str],
        config: PolicyConfig,
        retention: Mapping[str, RetentionPolicy] | None = None,
        demotion: Mapping[str, Demotion] | None = None,
    ) -> Policy:
        """The policy a ``policy:`` section configures for these tiers (fastest first): ``keep: K`` is
        :class:`KeepLatest(K) <tierckpt.policies.KeepLatest>` (absent: keep all), ``demote`` the
        :class:`~tierckpt.policies.Demotion` of its keys; ``retention``/``demotion``: per tier, policy
        objects that override the configured ones."""
        keep: dict[str, RetentionPolicy] = {
            n: KeepLatest(config.keep[n]) if n in config.keep else KeepAll() for n in tiers
        }
        demote = {n: Demotion.from_settings(d.every, d.every_secs, d.on_close) for n, d in config.demote.items()}
        return cls(
            tuple(tiers),
            {**demote, **(demotion or {})},
            {**keep, **(retention or {})},
            dict(config.on_full),
            config.promote_on_restore,
        )

    @property
    def reads_clock(self) -> bool:
        """Whether a save's plan depends on the time (a demotion rule with ``every_secs``, or one this
        module does not know): only then must the ranks of a job share one rank's plan."""
        return any(_reads_clock(d.rule) for d in self.demotion.values())

    def __post_init__(self) -> None:
        if not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"Policy.tiers: expected unique tier names, got {self.tiers}")
        for what, names in (("demotion", self.demotion), ("retention", self.retention), ("on_full", self.on_full)):
            for n in names:
                if n not in self.tiers or (what == "demotion" and n == self.tiers[0]):
                    raise ValueError(f"Policy.{what}: {n!r} is not a tier below the top one ({self.tiers})")
        for n, v in self.on_full.items():
            if v not in ON_FULL:
                raise ValueError(f"Policy.on_full[{n!r}]: expected one of {ON_FULL}, got {v!r}")


@dataclass(frozen=True)
class Sent:
    """The demotion cadence of one tier below the top: saves made since the last one sent there, and
    when (on the hierarchy's clock) that one was sent."""

    saves: int = 0
    at: float = 0.0


@dataclass(frozen=True)
class CatalogView:
    """What placement reads of a hierarchy's catalog: plain data, one rank's view.

    Attributes:
        committed: per tier (fastest first), the steps committed there.
        wanted: per step saved by this hierarchy, the tiers the policy sent it to (failed ones included).
        protected: ``(step, tier)`` copies retention must not evict now (read by a transfer, freshly
            promoted, or of the newest save).
        pinned: ``(step, tier)`` copies a running transfer reads (a full tier may wait for them).
        held: ``(step, tier)`` copies retention keeps beyond their window (the last :class:`Retain` plan's).
        sent: per tier below the top, its demotion cadence.
    """

    committed: Mapping[str, Sequence[int]] = field(default_factory=dict)
    wanted: Mapping[int, Collection[str]] = field(default_factory=dict)
    protected: Collection[tuple[int, str]] = ()
    pinned: Collection[tuple[int, str]] = ()
    held: Collection[tuple[int, str]] = ()
    sent: Mapping[str, Sent] = field(default_factory=dict)


# -- events ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Save:
    """A save of ``step`` at time ``now``; ``holders``: tiers holding an older copy of the step (a step
    saved again: they get the new bytes too, due or not, or they would restore the old ones later)."""

    step: int
    now: float
    holders: Collection[str] = ()


@dataclass(frozen=True)
class Prefetch:
    """Bring ``step`` up to tier ``to``; ``holders``: the tiers where it is committed."""

    step: int
    to: str
    holders: Collection[str]


@dataclass(frozen=True)
class Restored:
    """A restore (from any tier it liked) read ``step`` from tier ``read_from``."""

    step: int
    read_from: str


@dataclass(frozen=True)
class Close:
    """``close()`` or preemption: ``step`` is the newest committed step (None: none) and ``holders`` its tiers."""

    step: int | None
    holders: Collection[str] = ()


@dataclass(frozen=True)
class Retain:
    """A copy was committed or a tier changed: which copies go now."""


@dataclass(frozen=True)
class MakeRoom:
    """``tier`` is full while ``step`` is written to it: its configured capacity, or (``device``) the
    device under it."""

    tier: str
    step: int
    device: bool = False


# -- plans -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Copy:
    """One copy of a step to one tier.

    Attributes:
        dst: the destination tier.
        sources: where the bytes come from, nearest first: the first whose copy succeeds is read. Empty
            for the first copy of a save, which is packed from the caller's state.
        fallback: when every source failed, pack the caller's state into ``dst`` (a save's lower copies,
            while the state is not staged yet).
        promoted: a copy up the chain; retention leaves it until a newer save commits on ``dst``.
    """

    dst: str
    sources: tuple[str, ...] = ()
    fallback: bool = False
    promoted: bool = False


@dataclass(frozen=True)
class SavePlan:
    """Where a save goes: ``copies[0]`` packs the state into the top tier, each later copy demotes it.

    Attributes:
        step: the step.
        copies: the copies, in the order they are made.
        sent: the demotion cadences after this save.
        replaced: tiers that get this save only because they held an older copy of its step.
    """

    step: int
    copies: tuple[Copy, ...]
    sent: Mapping[str, Sent]
    replaced: tuple[str, ...] = ()

    @property
    def tiers(self) -> tuple[str, ...]:
        """The destination tiers, fastest first."""
        return tuple(c.dst for c in self.copies)


@dataclass(frozen=True)
class CopyPlan:
    """Copies of one step (a prefetch's fill order, or the ``on_close`` copies).

    Attributes:
        step: the step (None: there is nothing to copy).
        copies: in order; a prefetch's first copy is its target.
        there: the tier that already holds the step at or above a prefetch's target (the copies are empty).
        unreachable: ``on_close`` tiers no tier above them holds the step for.
    """

    step: int | None
    copies: tuple[Copy, ...] = ()
    there: str | None = None
    unreachable: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoomPlan:
    """What a full tier does: evict ``victims[0]`` (another tier holds it) and try again; else ``wait``
    for a running transfer to release its copies (backpressure), or fail (``wait`` False).

    Attributes:
        victims: evictable steps, oldest first.
        wait: nothing can go now, but copies pinned by transfers will (and ``on_full`` is ``wait``).
        waiting_on: those pinned steps.
    """

    victims: tuple[int, ...] = ()
    wait: bool = False
    waiting_on: tuple[int, ...] = ()


# -- the function ------------------------------------------------------------------------------------------
@overload
def place(event: Save, policy: Policy, catalog: CatalogView) -> SavePlan: ...
@overload
def place(event: Prefetch | Restored | Close, policy: Policy, catalog: CatalogView) -> CopyPlan: ...
@overload
def place(event: Retain, policy: Policy, catalog: CatalogView) -> RetentionPlan: ...
@overload
def place(event: MakeRoom, policy: Policy, catalog: CatalogView) -> RoomPlan: ...
def place(
    event: Save | Prefetch | Restored | Close | Retain | MakeRoom, policy: Policy, catalog: CatalogView
) -> SavePlan | CopyPlan | RetentionPlan | RoomPlan:
    """Decide what moves where for ``event``: the one place such decisions are made (pure, no I/O).

    Args:
        event: what happened.
        policy: the hierarchy's policy.
        catalog: what the hierarchy knows of its copies.

    Returns:
        The event's plan (see the module docstring).
    """
    if isinstance(event, Save):
        return _place_save(event, policy, catalog)
    if isinstance(event, Prefetch):
        return _place_prefetch(event, policy)
    if isinstance(event, Restored):  # promote_on_restore: up to the top tier, as a prefetch would
        if not policy.promote_on_restore:
            return CopyPlan(event.step, there=event.read_from)
        return _place_prefetch(Prefetch(event.step, policy.tiers[0], {event.read_from}), policy)
    if isinstance(event, Close):
        return _place_close(event, policy)
    if isinstance(event, Retain):
        return plan_retention(
            {t: catalog.committed.get(t, ()) for t in policy.tiers}, policy.retention, catalog.wanted, catalog.protected
        )
    if isinstance(event, MakeRoom):
        return _place_room(event, policy, catalog)
    raise TypeError(f"place: unknown event {event!r}")


def _reads_clock(rule: object) -> bool:
    if isinstance(rule, AnyOf):
        return any(_reads_clock(r) for r in rule.rules)
    return not isinstance(rule, (Every, Never))


def _place_save(event: Save, policy: Policy, catalog: CatalogView) -> SavePlan:
    """The top tier, each lower tier whose demotion rule is due, and each tier holding an older copy."""
    sent = dict(catalog.sent)
    dests = [policy.tiers[0]]
    for name in policy.tiers[1:]:
        s = sent.get(name, Sent(0, event.now))
        saves = s.saves + 1
        if policy.demotion.get(name, Demotion()).rule.due(Cadence(saves, event.now - s.at)):
            dests.append(name)
            sent[name] = Sent(0, event.now)
        else:
            sent[name] = Sent(saves, s.at)
    replaced = tuple(n for n in policy.tiers[1:] if n not in dests and n in event.holders)
    dests = [n for n in policy.tiers if n in dests or n in replaced]
    copies = [Copy(dests[0])]
    copies += [Copy(name, tuple(dests[:i][::-1]), fallback=True) for i, name in enumerate(dests) if i]
    return SavePlan(event.step, tuple(copies), sent, replaced)


def _place_prefetch(event: Prefetch, policy: Policy) -> CopyPlan:
    """``to`` first, straight from the fastest holder (a restart waits for one read of the slow tier);
    the tiers in between then from ``to``'s copy, or from the holder if that failed."""
    index = {n: i for i, n in enumerate(policy.tiers)}
    src = min(event.holders, key=index.__getitem__)
    if index[src] <= index[event.to]:
        return CopyPlan(event.step, there=src)
    between = policy.tiers[index[event.to] + 1 : index[src]]
    copies = [Copy(event.to, (src,), promoted=True)]
    copies += [Copy(name, (event.to, src), promoted=True) for name in between]
    return CopyPlan(event.step, tuple(copies))


def _place_close(event: Close, policy: Policy) -> CopyPlan:
    """The newest step to each ``on_close`` tier that lacks it, from the tiers above it, nearest first."""
    if event.step is None:
        return CopyPlan(None)
    copies, unreachable = [], []
    for i, name in enumerate(policy.tiers):
        if not i or not policy.demotion.get(name, Demotion()).on_close or name in event.holders:
            continue
        above = tuple(n for n in policy.tiers[:i][::-1] if n in event.holders)
        if above:
            copies.append(Copy(name, above))
        else:
            unreachable.append(name)
    return CopyPlan(event.step, tuple(copies), unreachable=tuple(unreachable))


def _place_room(event: MakeRoom, policy: Policy, catalog: CatalogView) -> RoomPlan:
    """A full tier gives up its oldest copy that another tier holds, never a protected or held one; if
    none can go, it waits while transfers still pin copies on it (``on_full: wait``), else fails. A full
    device (not a budget the policy set: the disk ran out) gives up only copies a lower tier holds, so
    that it never leaves a step on faster, less durable tiers alone."""
    here = catalog.committed.get(event.tier, ())
    others = policy.tiers[policy.tiers.index(event.tier) + 1 :] if event.device else policy.tiers
    elsewhere = {s for t, steps in catalog.committed.items() if t != event.tier and t in others for s in steps}
    keep = {s for s, t in (*catalog.protected, *catalog.pinned, *catalog.held) if t == event.tier}
    victims = capacity_victims(here, elsewhere, keep, exclude=event.step)
    if victims:
        return RoomPlan(tuple(victims))
    pinned = tuple(sorted({s for s, t in catalog.pinned if t == event.tier} - {event.step}))
    return RoomPlan(wait=bool(pinned) and policy.on_full.get(event.tier, "wait") == "wait", waiting_on=pinned)
