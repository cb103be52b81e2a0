"""A restore's job, from the step asked for to the state returned (:class:`RestoreJob`), the counterpart of
a save's :class:`~tierckpt.background.savejob.SaveJob`. Its decisions are the pure rules of
:mod:`tierckpt.facade.choose`; it does the listing, the reads and the agreements.

The lifecycle of one restore (docs/restore.md, docs/distributed.md "Restore: every rank the same step"):

1. **choose** — the step asked for; else this rank's newest committed step, and the ranks agree on the
   smallest of theirs (:meth:`~tierckpt.ranks.coordinator.Coordinator.agree_step`); its copies, fastest
   tier first;
2. **read** — one copy, every byte verified as it streams in (:class:`CopyReader`: datapath/restore.py,
   restore_into.py, reshard.py);
3. **fall back** — a damaged or unreadable copy: the next tier's. A copy that went away while it was being
   opened: list again and read again (bounded). A copy the step's record does not name: where another
   process may be saving the step again (a read-only hierarchy), look again a moment, then the next
   tier's; else the next tier's at once. A step that no tier of this rank can read: the newest older one;
4. **agree** — every rank proposes the step it read, or the older step it can try next; the ranks agree
   on the smallest, and go on until every rank has read the same step (so no two ranks return different
   steps), or stop together, each naming why (a rank with nothing left to try raises its own error, the
   others a :class:`~tierckpt.errors.CoordinationError` naming it).

With a step given, no step is agreed (every rank asked for it), but the ranks end in one gather of their
outcomes: every rank returns the step, or every rank raises (a rank that could not read it its own error,
the others a :class:`~tierckpt.errors.CoordinationError` naming it); with replicated DTensors in ``into``,
that is the exchange's own agreement (:func:`~tierckpt.datapath.replicas.settled`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from tierckpt.background.catalog import CheckpointInfo
from tierckpt.datapath.keymap import KeyMap
from tierckpt.datapath.replicas import ReplicaExchange, replica_exchange, settled
from tierckpt.datapath.restore import read_checkpoint
from tierckpt.datapath.restore_into import RestoreStaging
from tierckpt.errors import CheckpointNotFoundError, CoordinationError
from tierckpt.facade.choose import (
    LOOK_AGAIN,
    MAX_LOOKS,
    Again,
    Done,
    Failures,
    GiveUp,
    Kind,
    Next,
    TooMany,
    after_copies,
    after_round,
    describe,
    kind_of,
    name_failures,
    nothing_to_read,
    proposal,
    too_many,
    unusable,
)
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["CopyReader", "RestoreJob"]

log = logging.getLogger("tierckpt.hierarchy")
_ERR_CHARS = 2000  # of a rank's error, when the ranks stop
_stops: weakref.WeakKeyDictionary[Coordinator, itertools.count[int]] = weakref.WeakKeyDictionary()
Read = Callable[[int, str, ReplicaExchange | None], Any]


@dataclass
class CopyReader:
    """Reads one copy of this rank's part of a step: ``reader(step, tier_name, replicas)``.

    Attributes:
        tiers: the hierarchy's tiers.
        rank: this rank.
        staging: the staging buffers of in-place restores (and the tiers a resharding restore takes
            other ranks' copies from).
        into: the state restored into (None: fresh CPU tensors).
        allow_pickle: accept pickled values.
        strict: with ``into``, the keys of every dict must match.
        key_map: the checkpoint's key paths mapped to the target's (:mod:`tierckpt.datapath.keymap`).
    """

    tiers: Sequence[Tier]
    rank: int
    staging: RestoreStaging
    into: Any = None
    allow_pickle: bool = False
    strict: bool = True
    key_map: KeyMap | None = None

    def __call__(self, step: int, tier: str, replicas: ReplicaExchange | None) -> Any:
        t = next(x for x in self.tiers if x.name == tier)
        key = CheckpointKey(step, self.rank)
        if self.into is None:  # another rank's copy that ``t`` lacks: from the first other tier holding it
            others = [x for x in self.tiers if x is not t]
            return read_checkpoint(t, key, allow_pickle=self.allow_pickle, others=others, key_map=self.key_map)[0]
        return self.staging.restore(
            t,
            key,
            self.into,
            allow_pickle=self.allow_pickle,
            strict=self.strict,
            replicas=replicas,
            key_map=self.key_map,
        )


@dataclass
class _Tried:
    """What this rank's reads of one step gave: the state and its tier, or each tier's failure."""

    listed: Sequence[CheckpointInfo]  # the latest listing
    state: Any = None
    tier: str | None = None  # read from (None: not read)
    failures: Failures = field(default_factory=list)
    gone: bool = False  # its copies went away and the step is listed no more


class RestoreJob:
    """One restore of this rank's part of a checkpoint (see the module docstring).

    Args:
        read: reads one copy (:class:`CopyReader`).
        listing: the committed steps, oldest first (only those on the tier asked for, if any).
        coordinator: the job's ranks (every rank runs the same restores, in the same order).
        into: the state restored into, or None.
        where: what ``listing`` lists, for messages (``rank 0 on any tier``).
        may_commit: another process may be saving on these tiers (a read-only hierarchy): a copy the
            step's record does not name may be a save of the step again that is about to commit.
        climbing: ``climbing(step)`` waits for a prefetch of ``step`` still climbing; True if it did.
    """

    def __init__(
        self,
        read: Read,
        listing: Callable[[], Sequence[CheckpointInfo]],
        coordinator: Coordinator,
        *,
        into: Any = None,
        where: str,
        may_commit: bool = False,
        climbing: Callable[[int], bool] = lambda step: False,
    ) -> None:
        self.read, self.listing, self.coordinator = read, listing, coordinator
        self.into, self.where, self.may_commit, self.climbing = into, where, may_commit, climbing
        self.looks = 0  # fresh listings after copies went away
        self.stale_looks = 0  # looks again at copies the step's record does not name
        self.skipped: dict[int, Failures] = {}  # steps unusable on every tier of this rank

    def run(self, step: int | None = None) -> tuple[Any, int, str]:
        """Restore ``step`` (None: the newest that every rank reads); returns (state, step, tier)."""
        if step is not None:
            replicas = replica_exchange(self.coordinator, self.into)

            def given() -> tuple[Any, int, str]:  # whatever it raises, every rank still takes part once
                self.climbing(step)
                return self._given(step, replicas)

            if replicas is not None:  # its agreement is every rank's outcome
                return settled(replicas, given)
            return self._together(step, given)
        return self._agreed()

    def _together(self, step: int, read: Callable[[], tuple[Any, int, str]]) -> tuple[Any, int, str]:
        """``read()`` of ``step``, then, where the coordinator connects ranks, one gather of every rank's
        outcome (on every path, so each rank's count of them stays in step): every rank returns its part
        of the step, or every rank raises (a rank that failed its own error, the others a
        :class:`~tierckpt.errors.CoordinationError` naming it and its error)."""
        if not self.coordinator.connects_ranks or self.coordinator.world_size < 2:
            return read()
        what = f"could not restore step {step}"
        try:
            got = read()
        except Exception as e:  # not a KeyboardInterrupt: that process is going away, the others time out
            self._outcome(e, what)
            raise  # pragma: no cover - _outcome raises this rank's error
        self._outcome(None, what)
        return got

    # -- a step given ----------------------------------------------------------------------------------
    def _given(self, step: int, replicas: ReplicaExchange | None) -> tuple[Any, int, str]:
        tried = self._try(step, replicas, None)
        if tried.tier is not None:
            return tried.state, step, tried.tier
        steps = [i.step for i in tried.listed if i.tiers]
        if tried.failures:
            raise unusable(step, tried.failures, steps)
        raise nothing_to_read(step, steps, {}, relisted=tried.gone, where=self.where)

    # -- the newest step every rank reads --------------------------------------------------------------
    def _agreed(self) -> tuple[Any, int, str]:
        listed: Sequence[CheckpointInfo] | None = None
        step: int | None = None  # None: agree on the newest
        while True:
            if step is None:
                listed = self.listing() if listed is None else listed
                step = self._newest(listed)
            if self.climbing(step):
                listed = None  # the prefetch may have added a faster copy: list again
            replicas = replica_exchange(self.coordinator, self.into)  # replicated DTensors: read once, exchanged
            try:
                tried = self._try(step, replicas, listed)
            except Exception as e:  # not about a copy (a target that does not match …): the ranks stop
                with contextlib.suppress(CoordinationError):  # where the others say what they read
                    self.coordinator.agree_step(None)
                self._stop(e)
            listed = tried.listed
            if tried.failures and tried.tier is None:
                self.skipped[step] = tried.failures
            steps = [i.step for i in listed if i.tiers]
            mine = proposal(step, tried.tier is not None, steps, self.skipped, gone=tried.gone)
            if mine == LOOK_AGAIN:
                self.looks += 1
                mine = mine if self.looks <= MAX_LOOKS else None
            move = after_round(step, self.coordinator.agree_step(mine))
            if isinstance(move, Done):
                if replicas is not None:
                    replicas.settle(step)
                if self.skipped:
                    log.warning(
                        "restored step %d: newer steps %s are unusable on every tier", step, sorted(self.skipped)
                    )
                assert tried.tier is not None  # every rank read it, this one too
                return tried.state, step, tried.tier
            if isinstance(move, Next):
                self._going_back(step, move.step, tried)
                step = move.step
            elif isinstance(move, Again):
                step, listed = None, None
                log.info("restore: a copy went away while being opened; listing the committed steps again")
            else:
                self._stop(self._own_error(step, mine, tried, steps))

    def _newest(self, listed: Sequence[CheckpointInfo]) -> int:
        """The newest step every rank has (this rank's newest not skipped, agreed)."""
        mine = max((i.step for i in listed if i.tiers and i.step not in self.skipped), default=None)
        agreed = self.coordinator.agree_step(mine)
        if agreed is None:
            if mine is None:
                steps = [i.step for i in listed if i.tiers]
                raise nothing_to_read(None, steps, self.skipped, relisted=self.looks > 0, where=self.where)
            raise CheckpointNotFoundError(
                f"rank {self.coordinator.rank}: some rank of the job has no committed checkpoint"
            )
        if agreed != mine:
            log.info("restore: step %d, the newest step every rank holds (this rank's newest: %s)", agreed, mine)
        return agreed

    def _going_back(self, step: int, to: int, tried: _Tried) -> None:
        if tried.tier is not None:
            log.warning(
                "restore: another rank cannot read step %d; step %d is the newest every rank may read", step, to
            )
        elif tried.failures:
            log.warning(
                "step %d is unusable on every tier that holds it (%s); trying step %d",
                step,
                describe(tried.failures),
                to,
            )

    def _own_error(self, step: int, mine: int | None, tried: _Tried, steps: Sequence[int]) -> BaseException | None:
        """This rank's error when the ranks stop: None where it proposed a step (another rank stopped)."""
        if mine is not None:
            return None
        if tried.gone:
            return too_many(self.where, step)
        if self.skipped:
            return nothing_to_read(None, steps, self.skipped, relisted=False, where=self.where)
        return CheckpointNotFoundError(
            f"step {step}, the newest step every rank of the job holds, is not committed for {self.where} "
            f"(committed steps: {list(steps)}), nor is an older one"
        )

    def _stop(self, own: BaseException | None) -> NoReturn:
        """Every rank stops: each says why (:meth:`_outcome`); this rank raises its own error, or one naming
        the ranks that stopped the restore and theirs."""
        self._outcome(own, "could not restore a step every rank has")
        raise CoordinationError("restore: the ranks stopped, and none said why", ())

    def _outcome(self, own: BaseException | None, what: str) -> None:
        """Every rank says how its restore ended (``own``: its error, None where it has none), in one
        gather; returns where no rank failed, else raises this rank's own error, or a
        :class:`~tierckpt.errors.CoordinationError` naming the ranks that failed (they ``what``) and their
        errors."""
        said = None if own is None else f"{type(own).__name__}: {own}"[:_ERR_CHARS]
        key = f"restore/{next(_stops.setdefault(self.coordinator, itertools.count(1)))}/outcome"
        try:
            verdict = self.coordinator.gather(key, said, name_failures)
        except CoordinationError:
            if own is None:
                raise
            raise own from None  # this rank's own error says more than the others' silence
        if own is not None:
            raise own
        ranks = [int(r) for r in verdict["ranks"]]
        if ranks:
            msg = f"restore: rank(s) {ranks} {what}: {verdict['said']}"
            raise CoordinationError(msg, tuple(ranks))

    # -- one step's copies -----------------------------------------------------------------------------
    def _try(self, step: int, replicas: ReplicaExchange | None, listed: Sequence[CheckpointInfo] | None) -> _Tried:
        """Read ``step`` from the first of its tiers that works, looking again where the rules say
        (:func:`~tierckpt.facade.choose.after_copies`)."""
        relisted = False
        while True:
            infos = self.listing() if listed is None else listed
            listed = None
            info = next((i for i in infos if i.step == step and i.tiers), None)
            if info is None:
                return _Tried(infos, gone=relisted)
            failures: Failures = []
            for i, name in enumerate(info.tiers):
                try:
                    state = self.read(step, name, replicas)
                except Exception as e:
                    kind = kind_of(e)
                    if kind is None:
                        raise
                    self._failed(step, name, kind, e, info.tiers[i + 1] if i + 1 < len(info.tiers) else None)
                    failures.append((name, e))
                    continue
                if failures:
                    log.warning("restored step %d from tier %r instead (%s)", step, name, describe(failures))
                return _Tried(infos, state, name, failures)
            move = after_copies(failures, self.looks, self.stale_looks, may_commit=self.may_commit)
            if isinstance(move, TooMany):
                raise too_many(self.where, step)
            if isinstance(move, GiveUp):
                return _Tried(infos, failures=failures)
            if move.stale:
                self.stale_looks += 1
            else:
                self.looks += 1
            log.info("step %d: a copy went away or is being replaced; listing the committed steps again", step)
            time.sleep(move.delay)
            relisted = True

    @staticmethod
    def _failed(step: int, tier: str, kind: Kind, e: BaseException, then: str | None) -> None:
        """Log one copy's failure: the tier, why (the error, shortened), and the tier read next (``then``;
        None: none left to try, because no other tier holds the step or the restore reads one tier). A
        damaged or unreadable copy is a warning."""
        why = {
            Kind.DAMAGED: "is corrupt",
            Kind.UNREADABLE: "could not be read",
            Kind.GONE: "went away while being opened",
            Kind.UNNAMED: "is not the copy the step's record names",
        }[kind]
        level = logging.INFO if kind in (Kind.GONE, Kind.UNNAMED) else logging.WARNING
        nxt = f"trying tier {then!r} next" if then is not None else "no tier left to try"
        log.log(level, "restore: step %d: the copy on tier %r %s (%s); %s", step, tier, why, _short(e), nxt)


def _short(e: BaseException, limit: int = 300) -> str:
    """``e`` for a log line: its type and its message's first line, at most ``limit`` characters (a longer
    one keeps its head and its tail, where a damaged copy's message names the tier, blob and key)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]} … {text[-half:]}"
