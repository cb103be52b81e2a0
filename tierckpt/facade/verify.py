"""``Hierarchy.verify``: every copy re-read and checked, while other processes may evict or replace it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tierckpt.background.catalog import CheckpointInfo
from tierckpt.datapath.restore import verify_checkpoint
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["holds", "verify_copies"]

log = logging.getLogger("tierckpt.hierarchy")
_REPLACED_TRIES = 3


def verify_copies(
    tiers: Sequence[Tier], infos: Sequence[CheckpointInfo], rank: int
) -> list[tuple[int, str, BaseException | None]]:
    """Re-read every copy of each step of ``infos`` on the tiers that hold it: (step, tier, error or None).

    A copy evicted while it is verified is left out (gone, not damaged); one replaced by a new save of
    its step while it is opened is verified again (up to 3 times, then left out)."""
    by_name = {t.name: t for t in tiers}
    return [
        (info.step, name, err)
        for info in infos
        for name in info.tiers
        for err in _verify_copy(by_name[name], CheckpointKey(info.step, rank))
    ]


def _verify_copy(tier: Tier, key: CheckpointKey) -> list[BaseException | None]:
    """[None] (good), [the error] (damaged) or [] (evicted or replaced meanwhile) for one copy."""
    for _ in range(_REPLACED_TRIES):
        try:
            verify_checkpoint(tier, key)
            return [None]
        except CheckpointNotFoundError:  # evicted by another process: gone, not damaged
            if holds(tier, key):
                continue  # replaced: verify the new copy
            log.info("step %d on tier %r was evicted while being verified: not listed", key.step, tier.name)
            return []
        except (CorruptCheckpointError, OSError) as e:
            return [e]
    log.info(
        "step %d on tier %r was replaced %d times while being verified: not listed",
        key.step,
        tier.name,
        _REPLACED_TRIES,
    )
    return []


def holds(tier: Tier, key: CheckpointKey) -> bool:
    """Whether ``tier`` holds ``key`` (False, with a warning, when it cannot tell: an unreachable tier
    holds nothing to verify, or to replace)."""
    try:
        return tier.holds(key)
    except Exception as e:  # an unreachable tier holds nothing more to verify
        log.warning("tier %r: cannot tell whether it holds step %d: %s", tier.name, key.step, e)
        return False
