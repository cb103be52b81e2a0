"""The rules of a restore (docs/restore.md, "Which step and which copy"; docs/distributed.md, "Restore:
every rank the same step"), as pure functions of what was listed and what failed, so that each is
tested without I/O; :class:`~tierckpt.facade.restorejob.RestoreJob` carries them out.

* what a copy's failure is (:func:`kind_of`): damaged, unreadable, gone while it was being opened, or not
  the copy the step's commit record names;
* after every copy of a step failed, whether to look again (:func:`after_copies`): a copy that went away
  makes the restore list again (bounded); a copy the record does not name may be a save of the step
  again that is about to commit, where another process may be saving (bounded, shorter); else the step
  is unusable for this rank;
* what this rank proposes once it has tried a step (:func:`proposal`) and what the ranks' agreement
  means (:func:`after_round`): every rank read it, every rank goes to an older step, every rank looks
  again, or the restore stops;
* the errors: :func:`unusable`, :func:`nothing_to_read`, and what the other ranks say when a rank
  stops (:func:`name_failures`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt.datapath.manifests import UnnamedCopyError
from tierckpt.errors import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, TierIOError

__all__ = [
    "LOOK_AGAIN",
    "MAX_LOOKS",
    "MAX_STALE_LOOKS",
    "Again",
    "Done",
    "Failures",
    "GiveUp",
    "Kind",
    "LookAgain",
    "Next",
    "Stop",
    "TooMany",
    "after_copies",
    "after_round",
    "backoff",
    "kind_of",
    "name_failures",
    "nothing_to_read",
    "proposal",
    "too_many",
    "unusable",
]

# Fresh listings after copies went away under the reader: each costs a listing and a few opens, and a
# copy is a snapshot once open, so only a writer that evicts faster than a reader opens exhausts this.
MAX_LOOKS = 50
# Looks at a copy the step's record does not name, where another process may be saving the step again
# (its commit writes the record that names it): ~3 s (backoff), then the copy is unusable.
MAX_STALE_LOOKS = 20
#: what a rank proposes when a copy of the agreed step went away and the step is listed no more: every
#: rank lists again and the ranks agree anew (steps are never negative)
LOOK_AGAIN = -1
Failures = list[tuple[str, BaseException]]


class Kind(enum.Enum):
    """What a copy's failure is."""

    DAMAGED = "damaged"  #: fails validation: the next tier's copy
    UNREADABLE = "unreadable"  #: an I/O error, or a copy no tier holds: the next tier's copy
    GONE = "gone"  #: went away while being opened (evicted or replaced): list again
    UNNAMED = "unnamed"  #: not the copy the step's record names: maybe a save of it again, not yet committed


def kind_of(e: BaseException) -> Kind | None:
    """What ``e``, raised by a read of one copy, says about the copy; None: not about the copy (the
    restore stops: a target that does not match, memory, a coordination failure)."""
    if isinstance(e, UnnamedCopyError):
        return Kind.UNNAMED
    if isinstance(e, CheckpointNotFoundError):
        return Kind.GONE
    if isinstance(e, CorruptCheckpointError):
        return Kind.DAMAGED
    if isinstance(e, OSError):
        return Kind.UNREADABLE
    return None


def backoff(looks: int) -> float:
    """Seconds to wait before look ``looks`` (1, 2, ...): 5 ms, doubling, at most 0.2 s (~9 s over 50):
    a save of the step again is unreadable from its new copy's rename until its record is in."""
    return min(0.2, 0.005 * 2.0 ** (looks - 1))


@dataclass(frozen=True)
class LookAgain:
    """List the committed steps again (after ``delay`` seconds) and read the step again."""

    delay: float
    stale: bool  #: for a copy the record does not name (counts against MAX_STALE_LOOKS)


@dataclass(frozen=True)
class GiveUp:
    """Every copy of the step failed for good: the step is unusable for this rank."""


@dataclass(frozen=True)
class TooMany:
    """Copies went away MAX_LOOKS times in a row: another process evicts faster than this one opens."""


def after_copies(failures: Failures, looks: int, stale_looks: int, *, may_commit: bool) -> LookAgain | GiveUp | TooMany:
    """What to do once every tier's copy of a step failed (``failures``: each tier's error, in order).

    Args:
        failures: (tier, error) of each copy tried.
        looks: fresh listings this restore made already after copies went away.
        stale_looks: looks again at copies the step's record does not name.
        may_commit: another process may be saving on these tiers (a read-only hierarchy: the job that
            writes them may be saving the step again); else (this hierarchy holds the tiers' leases) a
            copy the record does not name is what a save killed before its commit left, for good.
    """
    kinds = {kind_of(e) for _, e in failures}
    if Kind.GONE in kinds:
        return LookAgain(backoff(looks + 1), stale=False) if looks < MAX_LOOKS else TooMany()
    if Kind.UNNAMED in kinds and may_commit and stale_looks < MAX_STALE_LOOKS:
        return LookAgain(backoff(stale_looks + 1), stale=True)
    return GiveUp()


def too_many(where: str, step: int) -> CheckpointEvictedError:
    """The error of :class:`TooMany`."""
    return CheckpointEvictedError(
        f"steps on {where} were evicted or replaced by another process while being opened, "
        f"{MAX_LOOKS} times in a row (last: step {step})"
    )


# -- every rank the same step ---------------------------------------------------------------------------
def proposal(step: int, read: bool, listed: Sequence[int], skipped: Mapping[int, object], *, gone: bool) -> int | None:
    """What this rank says after it tried ``step`` (the ranks then agree on the smallest proposal,
    :meth:`~tierckpt.ranks.coordinator.Coordinator.agree_step`).

    Args:
        step: the step the ranks agreed to read.
        read: this rank read it.
        listed: the steps this rank lists now.
        skipped: steps this rank found unusable on every tier.
        gone: this rank's copy of ``step`` went away while being opened and ``step`` is listed no more.

    Returns:
        ``step`` (read); :data:`LOOK_AGAIN` (gone); else the newest listed step older than ``step`` and
        not skipped, or None (nothing older).
    """
    if read:
        return step
    if gone:
        return LOOK_AGAIN
    older = [s for s in listed if s < step and s not in skipped]
    return max(older) if older else None


@dataclass(frozen=True)
class Done:
    """Every rank read the step."""


@dataclass(frozen=True)
class Next:
    """Some rank could not read the step: every rank reads ``step``, the newest that each may read."""

    step: int


@dataclass(frozen=True)
class Again:
    """A rank's copy went away: every rank lists again and the ranks agree anew."""


@dataclass(frozen=True)
class Stop:
    """Some rank has no step left to try (or failed otherwise): every rank raises."""


def after_round(step: int, agreed: int | None) -> Done | Next | Again | Stop:
    """What the ranks' agreement on their proposals (:func:`proposal`) after reading ``step`` means: the
    smallest proposal is ``step`` only where every rank read it."""
    if agreed is None:
        return Stop()
    if agreed == LOOK_AGAIN:
        return Again()
    if agreed == step:
        return Done()
    return Next(agreed)


def name_failures(errors: Sequence[str | None]) -> dict[str, Any]:
    """Rank 0's summary of why the ranks stopped (``errors``: each rank's error, None where it had none):
    the ranks that failed and what they said (the first 8)."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    said = "; ".join(f"rank {r}: {e}" for r, e in failed[:8])
    if len(failed) > 8:
        said += f" (and {len(failed) - 8} more ranks)"
    return {"ranks": [r for r, _ in failed], "said": said}


# -- the errors -----------------------------------------------------------------------------------------
def describe(failures: Failures) -> str:
    """Each tier's failure, for messages."""
    return "; ".join(f"tier {n!r}: {e}" for n, e in failures)


def nothing_to_read(
    step: int | None, steps: Sequence[int], skipped: Mapping[int, Failures], *, relisted: bool, where: str
) -> BaseException:
    """The error when no listed step is left to try (``skipped``: those unusable on every tier, with
    their failures; ``step``: the step asked for, if any; ``relisted``: the listing was made again after
    copies went away)."""
    if skipped:
        newest = max(skipped)
        also = {s: f for s, f in sorted(skipped.items(), reverse=True) if s != newest}
        return unusable(newest, skipped[newest], steps, also=also)
    if relisted and step is not None:
        return CheckpointEvictedError(
            f"step {step} was evicted or replaced by another process while it was being opened "
            f"(committed steps on {where} now: {list(steps)})"
        )
    if step is None or not steps:
        return CheckpointNotFoundError(f"no committed checkpoint for {where}")
    return CheckpointNotFoundError(f"step {step} is not committed (committed steps: {list(steps)})")


def unusable(
    step: int, failures: Failures, steps: Sequence[int], also: Mapping[int, Failures] | None = None
) -> BaseException:
    """The error for a step no tier could read: the one failure as it is when there is nothing else to
    say, else one error naming every tier's failure and the older steps that exist (``also``: older
    steps that failed too, newest first, with their failures; the first three are described).

    Its type: :class:`CorruptCheckpointError` where every failure is damage; a
    :class:`CheckpointNotFoundError` where none is damage or I/O (copies the step's record does not
    name); else :class:`TierIOError` (an unreachable tier does not make a copy damaged)."""
    older = [s for s in steps if s < step]
    if len(failures) == 1 and not older and not also:
        return failures[0][1]
    msg = f"step {step} is unusable on every tier that holds it: {describe(failures)}"
    if also:
        shown = list(also.items())[:3]
        msg += "; older steps are unusable too: " + "; ".join(f"step {s}: {describe(f)}" for s, f in shown)
        if len(also) > len(shown):
            msg += f"; and steps {sorted(also)[: len(also) - len(shown)]}"
    elif older:
        msg += f"; older committed steps: {older} (restore(step=N) reads one)"
    corrupt = [e for _, e in failures if isinstance(e, CorruptCheckpointError)]
    io = [e for _, e in failures if kind_of(e) == Kind.UNREADABLE and not isinstance(e, CorruptCheckpointError)]
    err: BaseException
    if len(corrupt) == len(failures):
        first, damage = corrupt[0], CorruptCheckpointError(msg, step=step)
        damage.tier, damage.blob, damage.key, damage.rank = first.tier, first.blob, first.key, first.rank
        err = damage
    elif io:
        err = TierIOError(getattr(io[0], "errno", None), msg)
    else:
        err = CheckpointNotFoundError(msg)
    err.__cause__ = failures[0][1]
    return err
