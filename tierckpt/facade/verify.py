"""``Hierarchy.verify`` and ``tierckpt verify``: every rank's copy that a step's commit record names,
re-read and checked, while other processes may evict or replace it (docs/restore.md, "What a reader
sees").

Which copies: on each tier that holds the step, every rank its record names (a step written before
records: this rank's copy). A shared tier must hold each of them: one it lacks while the record is there
is reported. A node-local tier holds its node's ranks' copies only: the ranks it lacks are another
node's (``tierckpt verify`` opens every node's directory a ``{node}`` path expands to).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tierckpt.background.catalog import CheckpointInfo
from tierckpt.datapath.manifests import UnnamedCopyError
from tierckpt.datapath.restore import verify_checkpoint
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, TierIOError
from tierckpt.facade.choose import MAX_STALE_LOOKS, backoff
from tierckpt.format.record import decode_record
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["CopyCheck", "holds", "named_ranks", "verify_copies"]

log = logging.getLogger("tierckpt.hierarchy")
_REPLACED_TRIES = 3


@dataclass(frozen=True)
class CopyCheck:
    """One copy verified: its step, tier and rank, and what is wrong with it (None: nothing)."""

    step: int
    tier: str
    rank: int
    error: BaseException | None


def verify_copies(
    tiers: Sequence[Tier],
    infos: Sequence[CheckpointInfo],
    rank: int,
    *,
    may_commit: bool,
    ranks: Collection[int] | None = None,
    only: Collection[str] | None = None,
) -> list[CopyCheck]:
    """Re-read every copy of each step of ``infos`` on the tiers that hold it, of every rank the step's
    record there names, in the order (step, tier, rank).

    A copy evicted while it is verified is left out (gone, not damaged); one replaced by a new save of
    its step while it is opened is verified again (up to 3 times, then left out); one the step's record
    does not name is reported (an :class:`~tierckpt.datapath.manifests.UnnamedCopyError`), after a few
    looks again where a save of the step again may be about to commit (``may_commit``).

    Args:
        tiers: the hierarchy's tiers.
        infos: the steps, with the tiers holding each.
        rank: this rank (whose copy a step without a record has).
        may_commit: another process may be saving on these tiers.
        ranks: only these ranks' copies (None: every rank's).
        only: only these tiers (None: every tier).
    """
    by_name = {t.name: t for t in tiers}
    out = []
    for info in infos:
        for name in info.tiers:
            if only is not None and name not in only:
                continue
            tier = by_name[name]
            named = named_ranks(tier, info.step, rank)
            for r in named:
                if ranks is None or r in ranks:
                    key = CheckpointKey(info.step, r)
                    out += [
                        CopyCheck(info.step, name, r, e) for e in _verify_copy(tier, key, len(named) > 1, may_commit)
                    ]
    return out


def named_ranks(tier: Tier, step: int, rank: int) -> list[int]:
    """The ranks whose copies ``step``'s record on ``tier`` names ([``rank``]: it has none, or it cannot
    be read, which verifying ``rank``'s copy reports)."""
    try:
        data = tier.read_record(step)
        return list(range(decode_record(data, step).world_size)) if data is not None else [rank]
    except (OSError, CorruptCheckpointError):
        return [rank]


def _verify_copy(tier: Tier, key: CheckpointKey, name_rank: bool, may_commit: bool) -> list[BaseException | None]:
    """[None] (good), [the error] (damaged, or not the copy the record names, or missing where the
    record says it is) or [] (evicted or replaced meanwhile, or another node's) for one copy."""
    stale = replaced = 0
    while True:
        try:
            verify_checkpoint(tier, key, name_rank=name_rank)
            return [None]
        except UnnamedCopyError as e:  # a save of the step again, killed, or about to commit
            if not may_commit or stale >= MAX_STALE_LOOKS:
                return [e]
            stale += 1
            time.sleep(backoff(stale))
        except CheckpointNotFoundError as e:
            if holds(tier, key) and replaced < _REPLACED_TRIES:
                replaced += 1  # replaced: verify the new copy
                continue
            return _absent(tier, key, e, replaced)
        except (CorruptCheckpointError, OSError) as e:
            return [e]


def _absent(tier: Tier, key: CheckpointKey, e: CheckpointNotFoundError, replaced: int) -> list[BaseException | None]:
    """A copy the tier does not hold (any more): left out, or (a shared tier whose record still names
    it) reported missing."""
    if replaced:
        log.info(
            "step %d on tier %r was replaced %d times while being verified: not listed", key.step, tier.name, replaced
        )
        return []
    try:
        recorded = tier.read_record(key.step) is not None
    except OSError:
        recorded = False
    if not recorded:  # evicted by another process (the record goes first): gone, not damaged
        log.info("step %d on tier %r was evicted while being verified: not listed", key.step, tier.name)
        return []
    if not tier.capabilities.shared:  # a node-local tier: another node's rank
        return []
    return [
        TierIOError(
            errno.ENOENT,
            f"step {key.step} on tier {tier.name!r}: rank {key.rank}'s copy, which the step's record names, is missing ({e})",
        )
    ]


def holds(tier: Tier, key: CheckpointKey) -> bool:
    """Whether ``tier`` holds ``key`` (False, with a warning, when it cannot tell: an unreachable tier
    holds nothing to verify, or to replace)."""
    try:
        return tier.holds(key)
    except Exception as e:  # an unreachable tier holds nothing more to verify
        log.warning("tier %r: cannot tell whether it holds step %d: %s", tier.name, key.step, e)
        return False
