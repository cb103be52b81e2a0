"""What the hierarchy asks placement at each of its events, and with what.

:func:`~tierckpt.policies.place` is pure: it decides from an event and a view of the catalog. A
:class:`Planner` gathers what each event needs (which tiers already hold a step saved again, the clock as
the deciding rank reads it, the newest committed step at close), calls ``place`` and returns its plan; the
hierarchy hands the plan to the mover. It decides nothing itself and runs no I/O beyond asking the tiers
whether they hold a step saved again (a tier one rank lists for the others: the catalog).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tierckpt.background.catalog import Catalog, CheckpointInfo
from tierckpt.background.listing import Listing
from tierckpt.facade.verify import holds
from tierckpt.policies.placement import Close, CopyPlan, Policy, Prefetch, Restored, Save, SavePlan, place
from tierckpt.ranks.commit import DecisionKeys
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Planner"]

log = logging.getLogger("tierckpt.hierarchy")


class Planner:
    """Placement's plans for one hierarchy's saves, prefetches, restores and close.

    Args:
        tiers: the chain, fastest first.
        placement: the placement policy.
        catalog: the hierarchy's bookkeeping (placement reads its view).
        listing: what this rank lists on its tiers.
        coordinator: the ranks' agreement on a time-based cadence.
        keys: the hierarchy's decision names.
        clock: the clock cadences in seconds read (monotonic seconds).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        placement: Policy,
        catalog: Catalog,
        listing: Listing,
        coordinator: Coordinator,
        keys: DecisionKeys,
        clock: Callable[[], float],
    ) -> None:
        self.tiers, self.placement, self.catalog, self.listing = tuple(tiers), placement, catalog, listing
        self.coordinator, self.keys, self.clock = coordinator, keys, clock

    def save(self, key: CheckpointKey) -> SavePlan:
        """Where a save of ``key`` goes: one decision for every rank (a time-based cadence is read on the
        coordinator's deciding rank). A step saved again replaces its older copies on every tier that
        holds one; only a step no newer than one seen before can be held anywhere, so a new step asks no
        tier (a save must not wait for a slow shared tier)."""
        holders: list[str] = []
        if key.step <= self.listing.newest_step():
            holders = [t.name for t in self.tiers[1:] if self._holds(t, key)]
        now = (
            self.clock()
        )  # a plan from counts alone is the same on every rank; one that reads the clock reads one rank's
        if self.placement.reads_clock:
            now = float(self.coordinator.decide(self.keys.next("save", key.step), self.clock))
        plan = place(Save(key.step, now, holders), self.placement, self.catalog.view())
        if plan.replaced:
            log.info("step %d is saved again: its older copies on %s are replaced too", key.step, list(plan.replaced))
        return plan

    def _holds(self, tier: Tier, key: CheckpointKey) -> bool:
        """Whether ``tier`` holds ``key``: for a tier one rank listed for the others, as the catalog
        follows it (no rank asks such a tier per save); else as the tier says."""
        if self.listing.listed_once(tier.name):
            return key.step in self.listing.committed(tier)
        return holds(tier, key)

    def prefetch(self, info: CheckpointInfo, to: str) -> CopyPlan:
        """How ``info``'s step climbs to tier ``to``."""
        return place(Prefetch(info.step, to, info.tiers), self.placement, self.catalog.view())

    def restored(self, step: int, tier: str) -> CopyPlan:
        """What follows a restore of ``step`` from ``tier`` (``promote.on_restore``: a copy up the chain)."""
        return place(Restored(step, tier), self.placement, self.catalog.view())

    def close(self) -> CopyPlan:
        """What a flush sends where: the newest committed step to each tier with ``on_close``; a tier the
        step is only below is logged, not sent to."""
        infos = self.listing.committed_steps()
        newest = infos[-1] if infos else None
        event = Close(newest.step, newest.tiers) if newest else Close(None)
        plan = place(event, self.placement, self.catalog.view())
        for name in plan.unreachable:
            log.warning("flush: step %s is only below tier %r; not sent up", plan.step, name)
        if plan.copies:
            log.info("flush: sending step %d to %s", plan.step, [c.dst for c in plan.copies])
        return plan
