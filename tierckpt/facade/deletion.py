"""A step deleted from every tier at the user's request (``Hierarchy.delete``): :func:`delete_step`.

Deleting is evicting, asked for by the user instead of decided by retention: the same protocol rules
(:func:`~tierckpt.policies.protocol.eviction`, every record before any copy:
:func:`~tierckpt.policies.protocol.deletion`), carried out by the same executor, under the mover's
eviction lock (no retention pass evicts meanwhile), the space freed beside the tiers' workers. What is
particular to a deletion is done here: it waits for what this hierarchy is doing with the step, and in a
job of several ranks every rank calls it (as every rank calls ``save`` and ``restore``) and the ranks
meet once, in one gather: each says which tiers list the step for it, and rank 0, with every rank's
answer, removes the step's records from the shared tiers before any rank evicts its copies (as it does
for a retention pass's shared evictions). A step no rank lists anywhere is an error on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tierckpt.background.catalog import Catalog
from tierckpt.background.listing import Listing
from tierckpt.background.mover import Mover
from tierckpt.errors import CheckpointNotFoundError, TierckptError
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import Tier

__all__ = ["delete_step"]

log = logging.getLogger("tierckpt.hierarchy")


def delete_step(
    step: int,
    *,
    tiers: Sequence[Tier],
    catalog: Catalog,
    listing: Listing,
    mover: Mover,
    coordinator: Coordinator,
) -> list[str]:
    """Delete ``step`` from every tier of this rank (see the module docstring); the tiers that listed
    it for some rank, fastest first.

    The caller keeps new work on the step from being queued meanwhile (the hierarchy's lock).

    Raises:
        CheckpointNotFoundError: no tier lists the step for any rank (naming the steps committed).
        TierckptError: a commit record could not be removed (naming the tiers that still hold the step).
        CoordinationError: in a job, a rank did not take part in time.
    """
    busy = catalog.busy(step)
    if busy:
        log.info("delete: waiting for step %d's copies in flight (%s)", step, ", ".join(busy))
        catalog.wait_idle(step)
    info = next((i for i in listing.checkpoints() if i.step == step), None)
    here = list(info.tiers) if info is not None else []
    order = [t.name for t in tiers]
    shared = {t.name for t in tiers if t.capabilities.shared} if coordinator.world_size > 1 else set()

    def decide(heres: list[list[str]]) -> dict[str, Any]:
        """Rank 0, with every rank's tiers: which tiers list the step, and the shared ones whose records
        it removed (those it could not remove stay committed for every rank)."""
        held = [n for n in order if any(n in h for h in heres)]
        with mover.evict_lock:
            done = mover.ranks.decide_shared([(n, step) for n in held if n in shared])
        return {"held": held, "shared": [n for n, _ in done]}

    got = coordinator.gather(mover.keys.next("delete", step), here, decide)
    if not got["held"]:
        committed = [i.step for i in listing.committed_steps()]
        anyone = " of any rank" if coordinator.world_size > 1 else ""
        raise CheckpointNotFoundError(
            f"cannot delete step {step}: it is not committed on any tier{anyone} (committed steps: {committed})"
        )
    mine = [t for t in tiers if t.name in got["shared"] or (t.name in here and t.name not in shared)]
    log.info("delete: step %d from tiers %s", step, [t.name for t in mine])
    try:
        with mover.evict_lock:
            mover.ranks.delete(mine, step, free=False)
    finally:
        mover.reclaimer.free(t.name for t in mine)  # as retention's evictions: beside the workers
    kept = [n for n in got["held"] if n in shared and n not in got["shared"]]
    if kept:
        raise TierckptError(
            f"step {step} is still committed on tiers {kept}: rank 0 could not remove its commit record there (see "
            "rank 0's warning); its copies there stay whole, and delete() may be called again"
        )
    catalog.drop(step)
    return list(got["held"])
