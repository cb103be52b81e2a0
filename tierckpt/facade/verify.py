"""``Hierarchy.verify`` and ``tierckpt verify``: every rank's copy that a step's commit record names,
re-read and checked, while other processes may evict or replace it (docs/restore.md, "What a reader
sees").

Which copies: on each tier that holds the step, every rank its record names (a step written before
records: this rank's copy). A shared tier must hold each of them: one it lacks while the record is there
is reported. A node-local tier holds its node's ranks' copies only: the ranks it lacks are another
node's, except this rank's own copy of a step its job saved (a rank lists such a step only where its copy
is in place), and except a step whose record the tier holds with no copy of any rank it names (the
tier lists a step it cannot give). ``tierckpt verify`` opens every node's and every rank's directory of
the tiers whose paths hold ``{node}`` or ``{rank}``, and reports itself the ranks no directory holds.

A copy the step's record does not name may be a save of the step again that is about to commit (where
another process may be saving): it is looked at again, within one budget of about 3 s per
:class:`LookBudget` (one per verify), shared by every such copy, so that many of them do not wait one
after another.
"""

from __future__ import annotations

import enum
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

__all__ = ["STALE_WAIT", "CopyCheck", "LookBudget", "holds", "named_ranks", "verify_copies"]

log = logging.getLogger("tierckpt.hierarchy")
_REPLACED_TRIES = 3
#: seconds a verify may wait in all for copies the step's record does not name to be committed (a
#: restore's looks at one copy: :data:`~tierckpt.facade.choose.MAX_STALE_LOOKS`, with backoff)
STALE_WAIT = sum(backoff(n) for n in range(1, MAX_STALE_LOOKS + 1))


@dataclass(frozen=True)
class CopyCheck:
    """One copy verified: its step, tier and rank, and what is wrong with it (None: nothing)."""

    step: int
    tier: str
    rank: int
    error: BaseException | None


class LookBudget:
    """The time one verify may spend looking again at copies the step's record does not name, shared
    by all of them: the first such copy starts the clock; once it has run out, each is looked at once.

    Args:
        seconds: the budget (default: :data:`STALE_WAIT`).
    """

    def __init__(self, seconds: float = STALE_WAIT) -> None:
        self.seconds = seconds
        self._deadline: float | None = None

    def wait(self, looks: int) -> bool:
        """Wait before look ``looks`` (1, 2, ...) at one copy, within what is left of the budget; False
        (at once) when nothing is left."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.seconds
        left = self._deadline - now
        if left <= 0:
            return False
        time.sleep(min(backoff(looks), left))
        return True


def verify_copies(
    tiers: Sequence[Tier],
    infos: Sequence[CheckpointInfo],
    rank: int,
    *,
    may_commit: bool,
    ranks: Collection[int] | None = None,
    only: Collection[str] | None = None,
    world_size: int | None = None,
    budget: LookBudget | None = None,
) -> list[CopyCheck]:
    """Re-read every copy of each step of ``infos`` on the tiers that hold it, of every rank the step's
    record there names, in the order (step, tier, rank).

    A copy evicted while it is verified is left out (gone, not damaged); one replaced by a new save of
    its step while it is opened is verified again (up to 3 times, then left out); one the step's record
    does not name is reported (an :class:`~tierckpt.datapath.manifests.UnnamedCopyError`), after a few
    looks again where a save of the step again may be about to commit (``may_commit``, within
    ``budget``). A copy the record names that a tier lacks is reported (a ``TierIOError``, ``ENOENT``):
    on a shared tier; and, with ``world_size``, on a node-local one where it is this rank's own copy of a
    step saved by ``world_size`` ranks, or where the tier holds no copy of any rank the record names.

    Args:
        tiers: the hierarchy's tiers.
        infos: the steps, with the tiers holding each.
        rank: this rank (whose copy a step without a record has).
        may_commit: another process may be saving on these tiers.
        ranks: only these ranks' copies (None: every rank's).
        only: only these tiers (None: every tier).
        world_size: the number of ranks of this rank's job, where what this rank lists on its node-local
            tiers must be there (None: a tool that opens every node's directory and looks for the ranks
            none holds itself).
        budget: the time to wait for copies the record does not name (default: a new :class:`LookBudget`).
    """
    by_name = {t.name: t for t in tiers}
    looks = (budget or LookBudget()) if may_commit else None
    out = []
    for info in infos:
        for name in info.tiers:
            if only is None or name in only:
                out += _verify_step(by_name[name], info.step, rank, ranks, world_size, looks)
    return out


def _verify_step(
    tier: Tier,
    step: int,
    rank: int,
    ranks: Collection[int] | None,
    world_size: int | None,
    looks: LookBudget | None,
) -> list[CopyCheck]:
    """:func:`verify_copies` of one step on one tier."""
    named = named_ranks(tier, step, rank)
    out, elsewhere = [], []
    for r in named:
        if ranks is not None and r not in ranks:
            continue
        key = CheckpointKey(step, r)
        got = _verify_copy(tier, key, len(named) > 1, looks)
        if got is _ELSEWHERE and world_size is not None and r == rank and len(named) == world_size:
            got = _missing(tier, key, "(this rank's own copy, on its node's tier)")  # a rank lists it only there
        if not isinstance(got, _Left):
            out.append(CopyCheck(step, tier.name, r, got))
        elif got is _ELSEWHERE:
            elsewhere.append(r)
    if not out and elsewhere and world_size is not None and _bare(tier, step, named):
        out.append(CopyCheck(step, tier.name, rank, _no_copy(tier, step, named)))
    return out


def named_ranks(tier: Tier, step: int, rank: int) -> list[int]:
    """The ranks whose copies ``step``'s record on ``tier`` names ([``rank``]: it has none, or it cannot
    be read, which verifying ``rank``'s copy reports)."""
    try:
        data = tier.read_record(step)
        return list(range(decode_record(data, step).world_size)) if data is not None else [rank]
    except (OSError, CorruptCheckpointError):
        return [rank]


class _Left(enum.Enum):
    """What became of a copy that is not reported."""

    GONE = "gone"  #: evicted or replaced meanwhile: left out
    ELSEWHERE = "elsewhere"  #: a node-local tier lacks it, its record there: another node's (or missing)


_GONE, _ELSEWHERE = _Left.GONE, _Left.ELSEWHERE
Outcome = BaseException | None | _Left


def _verify_copy(tier: Tier, key: CheckpointKey, name_rank: bool, looks: LookBudget | None) -> Outcome:
    """None (good), the error (damaged, or not the copy the record names, or missing where the record
    says it is), :data:`_GONE` or :data:`_ELSEWHERE` for one copy."""
    stale = replaced = 0
    while True:
        try:
            verify_checkpoint(tier, key, name_rank=name_rank)
            return None
        except UnnamedCopyError as e:  # a save of the step again, killed, or about to commit
            stale += 1
            if looks is None or not looks.wait(stale):
                return e
        except CheckpointNotFoundError as e:
            if holds(tier, key) and replaced < _REPLACED_TRIES:
                replaced += 1  # replaced: verify the new copy
                continue
            return _absent(tier, key, e, replaced)
        except (CorruptCheckpointError, OSError) as e:
            return e


def _absent(tier: Tier, key: CheckpointKey, e: CheckpointNotFoundError, replaced: int) -> Outcome:
    """A copy the tier does not hold (any more): left out, another node's, or (a shared tier whose
    record still names it) reported missing."""
    if replaced:
        log.info(
            "step %d on tier %r was replaced %d times while being verified: not listed", key.step, tier.name, replaced
        )
        return _GONE
    if not _recorded(tier, key.step):  # evicted by another process (the record goes first): gone, not damaged
        log.info("step %d on tier %r was evicted while being verified: not listed", key.step, tier.name)
        return _GONE
    if not tier.capabilities.shared:  # a node-local tier: another node's rank (or missing: the caller says)
        return _ELSEWHERE
    return _missing(tier, key, f"({e})")


def _recorded(tier: Tier, step: int) -> bool:
    try:
        return tier.read_record(step) is not None
    except OSError:
        return False


def _missing(tier: Tier, key: CheckpointKey, why: str) -> TierIOError:
    return TierIOError(
        errno.ENOENT,
        f"step {key.step} on tier {tier.name!r}: rank {key.rank}'s copy, which the step's record names, is "
        f"missing {why}",
    )


def _bare(tier: Tier, step: int, named: Sequence[int]) -> bool:
    """Whether ``tier`` holds ``step``'s record and no copy of any rank it names (after the record was
    read: a step evicted meanwhile has lost its record first)."""
    return not any(holds(tier, CheckpointKey(step, r)) for r in named) and _recorded(tier, step)


def _no_copy(tier: Tier, step: int, named: Sequence[int]) -> TierIOError:
    return TierIOError(
        errno.ENOENT,
        f"step {step} on tier {tier.name!r}: the tier holds the step's commit record and no copy of any of "
        f"the {len(named)} ranks it names (the copies of the ranks that wrote it here are missing)",
    )


def holds(tier: Tier, key: CheckpointKey) -> bool:
    """Whether ``tier`` holds ``key`` (False, with a warning, when it cannot tell: an unreachable tier
    holds nothing to verify, or to replace)."""
    try:
        return tier.holds(key)
    except Exception as e:  # an unreachable tier holds nothing more to verify
        log.warning("tier %r: cannot tell whether it holds step %d: %s", tier.name, key.step, e)
        return False
