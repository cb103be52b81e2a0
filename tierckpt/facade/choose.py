"""Which copy a restore reads: the fastest good copy of the step asked for, or of the newest step that
restores, while other processes may evict or replace steps (docs/restore.md, "What a reader sees").

Pure control flow over two callables (the hierarchy's listing and one copy's read), so that the rules
are in one place: a damaged copy falls back to the next tier; a copy that went away while it was being
opened (CheckpointNotFoundError from the tier) makes the choice start over from a fresh listing; with
no step given, a step damaged on every tier is skipped for the newest older one, with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from tierckpt.background.catalog import CheckpointInfo
from tierckpt.datapath.replicas import ReplicaExchange, replica_exchange, settled
from tierckpt.errors import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, TierIOError
from tierckpt.ranks.coordinator import Coordinator, agreed_step

__all__ = ["MAX_RELISTS", "choose_and_read", "read_agreed", "unusable"]

log = logging.getLogger("tierckpt.hierarchy")
# Fresh listings after copies went away under the reader: each costs a listing and a few opens, and a
# copy is a snapshot once open, so only a writer that evicts faster than a reader opens exhausts this.
MAX_RELISTS = 50
Failures = list[tuple[str, BaseException]]


def read_agreed(
    step: int | None,
    coordinator: Coordinator,
    listing: Callable[[], Sequence[CheckpointInfo]],
    climbing: Callable[[int | None], bool],
    read: Callable[[int, str, ReplicaExchange | None], Any],
    into: Any,
    where: str,
) -> tuple[Any, int, str]:
    """Read the step every rank of the job restores (docs/distributed.md, "Restore: every rank the same
    step"): ``step`` as asked, or (None) the newest one every rank can read: the smallest of each rank's
    newest, agreed through ``coordinator``, then agreed again on the step each rank really read (one may
    have fallen back to an older step), read again where they differ.

    Args:
        step: the step asked for, or None.
        coordinator: the ranks' coordinator.
        listing: committed steps (see :func:`choose_and_read`).
        climbing: ``climbing(step)`` waits for a prefetch of ``step`` still climbing; True if it did
            (the listing changed).
        read: reads one copy: ``read(step, tier_name, replicas)`` (``replicas``: the job's exchange of
            replicated DTensors, or None; :mod:`tierckpt.datapath.replicas`).
        into: the restore's target (None: fresh tensors).
        where: what was listed, for messages.

    Returns:
        (the state, its step, the tier it was read from).
    """
    asked = step
    while True:
        listed: list[Sequence[CheckpointInfo]] = []
        if step is None:  # this rank's newest, then the one every rank agreed on
            listed.append(listing())  # also the read's first listing
            step = agreed_step(coordinator, listed[0][-1].step if listed[0] else None)
        if climbing(step):
            listed.clear()  # the prefetch may have added a faster copy: list again
        replicas = replica_exchange(coordinator, into)  # a job's replicated DTensors: read once, exchanged
        state, got, name = settled(replicas, partial(_read_once, listing, listed, read, replicas, step, where))
        if asked is not None:
            return state, got, name
        agreed = agreed_step(coordinator, got)  # a rank that fell back: every rank restores the same step
        if agreed is None and replicas is not None and replicas.again:  # it holds its pieces only
            agreed = got
        if agreed is None:
            return state, got, name
        log.warning("restore: step %d is the newest step every rank could read; reading it", agreed)
        asked = step = agreed


def _read_once(
    listing: Callable[[], Sequence[CheckpointInfo]],
    listed: list[Sequence[CheckpointInfo]],
    read: Callable[[int, str, ReplicaExchange | None], Any],
    replicas: ReplicaExchange | None,
    step: int | None,
    where: str,
) -> tuple[Any, int, str]:
    return choose_and_read(
        lambda: listed.pop() if listed else listing(), lambda s, n: read(s, n, replicas), step, where
    )


def choose_and_read(
    listing: Callable[[], Sequence[CheckpointInfo]],
    read: Callable[[int, str], Any],
    step: int | None,
    where: str,
) -> tuple[Any, int, str]:
    """Read ``step`` (None: the newest step that restores) from the first of its tiers that works.

    Args:
        listing: committed steps (only those on the tier asked for, if any), oldest first.
        read: reads one copy: ``read(step, tier_name)``; raises CorruptCheckpointError or OSError
            for a bad copy, CheckpointNotFoundError for one that is not there (any more).
        step: the step asked for, or None.
        where: what was listed, for messages (``rank 0 on any tier``).

    Returns:
        (the state, its step, the tier it was read from).
    """
    skipped: dict[int, Failures] = {}  # newest-first steps damaged on every tier (step=None only)
    relists = 0
    while True:
        infos = [i for i in listing() if i.tiers]
        steps = [i.step for i in infos]
        if step is None:
            todo = [i for i in reversed(infos) if i.step not in skipped]
        else:
            todo = [i for i in infos if i.step == step]
        if not todo:
            raise _nothing_to_read(step, steps, skipped, relisted=relists > 0, where=where)
        info = todo[0]
        failures: Failures = []
        got = _read_any(info, read, failures)
        if got is not None:
            if skipped:
                log.warning("restored step %d: newer steps %s are unusable on every tier", info.step, sorted(skipped))
            return got[0], info.step, got[1]
        if any(isinstance(e, CheckpointNotFoundError) for _, e in failures):
            relists += 1
            if relists > MAX_RELISTS:
                raise CheckpointEvictedError(
                    f"steps on {where} were evicted or replaced by another process while being opened, "
                    f"{MAX_RELISTS} times in a row (last: step {info.step})"
                )
            log.info("step %d: a copy went away while being opened; listing the committed steps again", info.step)
            # a step saved again is unreadable from its new copy's rename until its new record is in (every
            # rank's copy): give that save a moment (5 ms, doubling, at most 0.2 s: ~9 s in all)
            time.sleep(min(0.2, 0.005 * 2 ** (relists - 1)))
            continue
        if step is not None:
            raise unusable(info.step, failures, steps)
        skipped[info.step] = failures
        older = [s for s in steps if s < info.step and s not in skipped]
        if older:
            log.warning(
                "step %d is unusable on every tier that holds it (%s); trying step %d",
                info.step, _describe(failures), older[-1],
            )  # fmt: skip


def _read_any(info: CheckpointInfo, read: Callable[[int, str], Any], failures: Failures) -> tuple[Any, str] | None:
    """``(state, tier)`` from the first of ``info``'s tiers whose copy reads, or None; each tier that
    fails is added to ``failures``."""
    for name in info.tiers:
        try:
            state = read(info.step, name)
        except CheckpointNotFoundError as e:
            log.info("step %d on tier %r went away while being opened (%s)", info.step, name, e)
            failures.append((name, e))
            continue
        except (CorruptCheckpointError, OSError) as e:
            log.warning("step %d on tier %r is unusable (%s); trying the next tier", info.step, name, e)
            failures.append((name, e))
            continue
        if failures:
            log.warning("restored step %d from tier %r instead", info.step, name)
        return state, name
    return None


def _nothing_to_read(
    step: int | None, steps: Sequence[int], skipped: dict[int, Failures], *, relisted: bool, where: str
) -> BaseException:
    """The error when no listed step is left to try (``skipped``: those unusable on every tier)."""
    if skipped:
        newest = max(skipped)
        also = {s: f for s, f in sorted(skipped.items(), reverse=True) if s != newest}
        return unusable(newest, skipped[newest], steps, also=also)
    if relisted and step is not None:
        return CheckpointEvictedError(
            f"step {step} was evicted or replaced by another process while it was being opened "
            f"(committed steps on {where} now: {steps})"
        )
    if step is None or not steps:
        return CheckpointNotFoundError(f"no committed checkpoint for {where}")
    return CheckpointNotFoundError(f"step {step} is not committed (committed steps: {steps})")


def _describe(failures: Failures) -> str:
    return "; ".join(f"tier {n!r}: {e}" for n, e in failures)


def unusable(
    step: int, failures: Failures, steps: Sequence[int], also: Mapping[int, Failures] | None = None
) -> BaseException:
    """The error for a step no tier could read: the one failure as it is when there is nothing else to
    say, else one error naming every tier's failure and the older steps that exist (``also``: older
    steps that failed too, newest first, with their failures; the first three are described)."""
    older = [s for s in steps if s < step]
    if len(failures) == 1 and not older and not also:
        return failures[0][1]
    msg = f"step {step} is unusable on every tier that holds it: {_describe(failures)}"
    if also:
        shown = list(also.items())[:3]
        msg += "; older steps are unusable too: " + "; ".join(f"step {s}: {_describe(f)}" for s, f in shown)
        if len(also) > len(shown):
            msg += f"; and steps {sorted(also)[: len(also) - len(shown)]}"
    elif older:
        msg += f"; older committed steps: {older} (restore(step=N) reads one)"
    first = failures[0][1]
    corrupt = [e for _, e in failures if isinstance(e, CorruptCheckpointError)]
    if len(corrupt) == len(failures):
        err: BaseException = CorruptCheckpointError(msg, step=step)
        err.tier, err.blob, err.key = corrupt[0].tier, corrupt[0].blob, corrupt[0].key  # type: ignore[attr-defined]  # the error's location attributes are set after construction (CorruptCheckpointError's, via BaseException)
    else:
        io = next(e for _, e in failures if not isinstance(e, CorruptCheckpointError))
        err = TierIOError(getattr(io, "errno", None), msg)
    err.__cause__ = first
    return err
