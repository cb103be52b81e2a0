"""The mover: executes placement plans (:mod:`tierckpt.policies.placement`) on one worker per tier.

It decides nothing: which tiers a save goes to, the fill order of a prefetch, the ``on_close`` copies,
what retention evicts and what a full tier gives up all come from :func:`~tierckpt.policies.place`. The
mover runs each copy on its destination's worker (:mod:`~tierckpt.background.worker`), records every
state in the catalog, pins the sources a copy reads, applies retention after every change, and makes
room on a full tier as its plan says. Each job is background work (its reads and writes paced by the
tiers' bandwidth budgets: :mod:`~tierckpt.datapath.throttle`) unless its caller waits for it: a
prefetch, a blocking save.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

from tierckpt.background.catalog import Catalog
from tierckpt.background.executor import RankExecutor
from tierckpt.background.held import HeldCopies
from tierckpt.background.listing import Listing
from tierckpt.background.reclaim import Reclaimer
from tierckpt.background.worker import Worker
from tierckpt.datapath.blobcopy import staging_for
from tierckpt.datapath.codecwrite import CodecWriter
from tierckpt.datapath.copysource import open_copy_source
from tierckpt.datapath.storing import compresses, encodes_raw_frames, storing_writer
from tierckpt.datapath.throttle import throttled_writer
from tierckpt.errors import DeviceFullError, TierckptError, TierFullError
from tierckpt.format.codec import Encoded
from tierckpt.format.manifest import BlobEntry, Manifest, ManifestHead
from tierckpt.io.buffers import StagingPool
from tierckpt.io.geometry import IOGeometry
from tierckpt.policies.placement import Copy, CopyPlan, MakeRoom, Policy, Retain, place
from tierckpt.policies.protocol import unknown_outcome
from tierckpt.ranks.commit import DecisionKeys
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.ranks.nodeplace import place_key
from tierckpt.tiers.base import CheckpointKey, Tier, TierWriter

__all__ = ["Mover", "Room", "resolved"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def resolved() -> Future[None]:
    """A future already done, without error (a source that needs no waiting for)."""
    f: Future[None] = Future()
    f.set_result(None)
    return f


def _pool_of(geometry: IOGeometry) -> Callable[[], StagingPool]:
    """A factory of the staging pool of a tier of this geometry (a worker makes it on first use)."""
    return lambda: staging_for(geometry)


class Room:
    """What the mover lends a job that writes a checkpoint to one tier itself (a save's packing job):
    the tier and its geometry in the checkpoint's alignment, room on it (:meth:`reserve`, which makes
    room as the tier's full-tier plan says) and its worker's staging buffers; ``background``: whether the
    job's writes are paced by the tier's budget as background work."""

    def __init__(self, mover: Mover, tier: Tier, background: bool = True) -> None:
        self.tier = tier
        self.geometry = mover.geometries[tier.name]
        self.background = background
        self._mover = mover
        #: the key of the node's exchange for a copy to a ``node_files`` tier that every rank makes (set
        #: by the commit's job; None: a copy of this rank alone)
        self.place_key: str | None = None
        #: whether the job took part in that exchange (or failed in it): if not, its failure is told there
        self.placed = False

    @property
    def compresses(self) -> bool:
        """Whether the tier stores its copies encoded (:meth:`reserve` then wants the copy's manifest)."""
        return compresses(self.tier)

    def recodes(self, head: ManifestHead) -> bool:
        """Whether a copy of the compressed copy ``head`` to the tier encodes the frames it stored raw
        (:func:`~tierckpt.datapath.storing.encodes_raw_frames`: asked once a copy)."""
        return encodes_raw_frames(self.tier, head, chunk_bytes=self.geometry.chunk_bytes, background=self.background)

    def reserve(
        self,
        key: CheckpointKey,
        blobs: Sequence[BlobEntry],
        *,
        alone: bool = False,
        codec: Manifest | ManifestHead | None = None,
        held: Sequence[int] | None = None,
        decided: bool = False,
    ) -> TierWriter:
        """A writer for ``key`` on the tier (see :meth:`Mover.reserve`); ``alone``: a copy no other rank
        makes (a promotion), which shares no node file; ``codec``: the copy's manifest (or its plan),
        for a tier that :attr:`compresses`; ``held``: each blob's bytes where a compressed copy's
        stored streams are copied as they are; ``decided``: the copy is encoded (:meth:`recodes`)."""
        place = None if alone else self.place_key
        self.placed = self.placed or place is not None
        return self._mover.reserve(
            self.tier, key, blobs, background=self.background, place_key=place, codec=codec, held=held,
            decided=decided,
        )  # fmt: skip

    def staging(self) -> StagingPool:
        """The tier's worker's staging buffers (only that worker's thread uses them)."""
        return self._mover.workers[self.tier.name].pool()


#: A job that writes a checkpoint to the room's tier: returns the manifest it committed (the mover then
#: publishes the copy: :class:`~tierckpt.ranks.commit.Commits`), or None for a copy that needs no
#: commit of all ranks (a promotion, which copies the step's record along).
Job = Callable[[Room], bytes | None]


class _CommitsWithRoom(TierWriter):
    """A writer whose commit, when the tier's device is full (:class:`~tierckpt.errors.DeviceFullError`:
    the writer stays open, its blobs written), makes room as its reservation did and commits again."""

    def __init__(self, inner: TierWriter, room: Callable[[Callable[[], None]], None]) -> None:
        self._inner, self._room = inner, room

    def buffer(self, blob: int) -> torch.Tensor | None:
        return self._inner.buffer(blob)

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        return self._inner.write(blob, offset, addr, nbytes)

    def write_encoded(self, blob: int, k: int, enc: Encoded) -> Future[int]:
        """A frame handed over encoded, to a codec writer (:meth:`CodecWriter.write_encoded`)."""
        if not isinstance(self._inner, CodecWriter):
            raise TypeError(f"a writer of {type(self._inner).__name__} takes no encoded frames")
        return self._inner.write_encoded(blob, k, enc)

    def commit(self, manifest: bytes) -> None:
        self._room(lambda: self._inner.commit(manifest))

    def abort(self) -> None:
        self._inner.abort()

    def cancel(self) -> None:
        self._inner.cancel()


class _Pins:
    """The source copies one transfer keeps from eviction; each released once."""

    def __init__(self, catalog: Catalog, step: int, tiers: Sequence[str]) -> None:
        self._catalog, self._step, self._held = catalog, step, list(tiers)
        self._lock = threading.Lock()
        for t in self._held:
            catalog.pin(step, t)

    def release(self, keep: str | None = None) -> None:
        """Release every pin except ``keep``'s."""
        with self._lock:
            drop = [t for t in self._held if t != keep]
            self._held = [t for t in self._held if t == keep]
        for t in drop:
            self._catalog.unpin(self._step, t)


class Mover:
    """Runs a hierarchy's copies on per-tier workers and applies retention after each change.

    Args:
        tiers: the chain, fastest first.
        policy: the placement policy.
        catalog: the hierarchy's records.
        listing: what this rank lists on its tiers (the hierarchy's).
        coordinator: agrees with the other ranks on evictions from shared tiers.
        geometries: per tier name, its I/O geometry in the checkpoint's alignment: the chunk of copies to
            it, and its worker's staging buffers (:func:`~tierckpt.datapath.blobcopy.staging_for`).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: Policy,
        catalog: Catalog,
        listing: Listing,
        coordinator: Coordinator,
        geometries: Mapping[str, IOGeometry],
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.policy = policy
        self.catalog = catalog
        self.coordinator = coordinator
        self.rank = coordinator.rank
        self.geometries = dict(geometries)
        self.workers = {t.name: Worker(t.name, _pool_of(self.geometries[t.name])) for t in tiers}
        self.reclaimer = Reclaimer(lambda name: self.tiers[name].reclaim())  # evicted copies, freed beside the workers
        self.evict_lock = threading.Lock()  # retention passes and deletions (Hierarchy.delete), one at a time
        self._full_logged: set[str] = set()
        self.held = HeldCopies(catalog)  # copies retention keeps beyond their window, and why
        self.keys = DecisionKeys()
        self.ranks = RankExecutor(
            tiers, catalog, listing, coordinator, self.keys, self.with_room
        )  # the protocol's plans

    # -- plans ------------------------------------------------------------------------------------------
    def execute(self, plan: CopyPlan, *, background: bool = True) -> dict[str, Future[None]]:
        """Queue a plan's copies in order; per destination, a future resolving once it has committed.
        A copy's source that is an earlier destination of the plan is read once that one has committed.
        ``background=False``: a caller waits for the copies (a prefetch), which budgets do not pace
        unless they pace everything."""
        assert plan.step is not None, "a plan with nothing to copy"
        key = CheckpointKey(plan.step, self.rank)
        done: dict[str, Future[None]] = {}
        for c in plan.copies:
            done[c.dst] = Future()
            self.copy(key, c, done[c.dst], {s: done.get(s) or resolved() for s in c.sources}, background=background)
        return done

    def copy(
        self,
        key: CheckpointKey,
        c: Copy,
        done: Future[None],
        sources: Mapping[str, Future[None]],
        blobs: Sequence[BlobEntry] | None = None,
        fallback: Job | None = None,
        *,
        background: bool = True,
    ) -> None:
        """Queue one copy of a plan: from the first of ``c.sources`` whose future (in ``sources``)
        succeeds; ``fallback`` writes the checkpoint by other means when every source failed (only where
        the plan allows it)."""
        self.transfer(
            key, c.dst, [(s, sources[s]) for s in c.sources], done, blobs, c.promoted, fallback if c.fallback else None,
            background=background,
        )  # fmt: skip

    # -- jobs -------------------------------------------------------------------------------------------
    def run_commit(
        self, tier: str, step: int, job: Job, done: Future[None], announce: bool = True, *, background: bool = True
    ) -> Future[None]:
        """Run ``job`` (reserve, write, commit on ``tier``, with the :class:`Room` the mover lends it) on
        the tier's worker; record the outcome in the
        catalog and in ``done``; apply retention afterwards. With ``announce`` the step shows as
        ``writing`` as soon as the job starts; otherwise the job says so itself (a transfer, once its
        source has committed). ``background``: the job's writes are background work (see the module)."""

        room = Room(self, self.tiers[tier], background)
        key = CheckpointKey(step, self.rank)

        def run() -> None:
            # the commit this job ends in is the n-th of the step on the tier on every rank: so is its exchange
            room.place_key = place_key(tier, step, self.keys.count("commit", tier, step) + 1)
            if announce:
                self.catalog.set(step, tier, "writing")
            error: BaseException | None = None
            shared: list[tuple[str, int]] | None = None  # rank 0's evictions from shared tiers, with the commit
            try:
                try:
                    manifest = job(room)
                except BaseException as e:
                    if room.tier.node_files and room.place_key is not None and not room.placed:
                        self.ranks.skip_place(room.tier, key, room.place_key, e)  # its node's ranks wait there
                    self.ranks.abandon(room.tier, key)
                    raise
                if manifest is not None:
                    shared = self.ranks.publish(room.tier, key, manifest, self._shared_evictions)
            except BaseException as e:
                error = e
                self.catalog.set(step, tier, "failed", e, unknown=unknown_outcome(e))
                log.error("step %d: tier %r failed: %s", step, tier, e)
            else:
                self.catalog.set(step, tier, "committed")
                self.catalog.clear_promoted(tier, below=step)
            evicted: set[str] = set()
            try:
                # before the future resolves: after handle.wait(), retention has run (the evicted copies
                # are unlisted); their files are deleted after it, so a blocking save does not wait for that
                evicted = self.apply_retention(free=False, shared=shared if error is None else None)
            except Exception as e:  # retention problems are logged, never raised into a save
                log.warning("retention after step %d on tier %r failed: %s", step, tier, e)
            self.reclaimer.settle(tier)  # what earlier jobs evicted from it is freed (it overlapped this one)
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
            self.reclaimer.free(evicted)

        return self.workers[tier].submit(run)

    def transfer(
        self,
        key: CheckpointKey,
        dst: str,
        sources: Sequence[tuple[str, Future[None]]],
        done: Future[None],
        blobs: Sequence[BlobEntry] | None = None,
        promoted: bool = False,
        fallback: Job | None = None,
        *,
        background: bool = True,
    ) -> None:
        """Queue a copy of ``key`` to ``dst`` from the first of ``sources`` (nearest first) whose future
        succeeds. The sources are pinned until the copy is over (the ones not needed are released as
        soon as the nearest one has committed). If every source failed, ``fallback`` (when given) writes
        the checkpoint to ``dst`` by other means: a save whose upper tiers all failed packs the caller's
        state straight into ``dst``, as long as it was not staged yet."""
        pins = _Pins(self.catalog, key.step, [s for s, _ in sources])
        if sources:
            first = sources[0][0]
            sources[0][1].add_done_callback(lambda f: pins.release(keep=first) if f.exception() is None else None)

        def job(room: Room) -> bytes | None:
            if promoted:  # a copy of this rank alone: its node's ranks hold no exchange for it
                room.place_key = None
            try:
                try:
                    src = self._pick_source(key, dst, sources)
                except TierckptError:
                    if fallback is None:
                        raise
                    self.catalog.set(key.step, dst, "writing")
                    pins.release()
                    log.warning("step %d: every tier above %r failed; writing it there directly", key.step, dst)
                    return fallback(room)
                pins.release(keep=src)
                self.catalog.set(key.step, dst, "writing")
                manifest = self._copy(key, self.tiers[src], room, blobs, alone=promoted)
                if promoted:  # a cache of this rank's copy: no commit of all ranks (the protocol says what it needs)
                    self.ranks.promote(self.tiers[src], self.tiers[dst], key.step, manifest)
                    self.catalog.promoted(key.step, dst, True)
                    return None
                return manifest
            finally:
                pins.release()

        self.catalog.plan(key.step, [dst])
        self.run_commit(dst, key.step, job, done, announce=False, background=background)

    def _pick_source(self, key: CheckpointKey, dst: str, sources: Sequence[tuple[str, Future[None]]]) -> str:
        causes: list[tuple[str, BaseException]] = []
        for name, fut in sources:
            err = fut.exception()
            if err is None:
                return name
            causes.append((name, err))
        what = "; ".join(f"{n}: {e}" for n, e in causes) or "no source tier"
        raise TierckptError(f"step {key.step} cannot reach tier {dst!r}: no tier above it holds a copy ({what})") from (
            causes[0][1] if causes else None
        )

    def _copy(self, key: CheckpointKey, src: Tier, room: Room, blobs: Sequence[BlobEntry] | None, alone: bool) -> bytes:
        """Copy ``key`` from ``src`` to the room's tier blob by blob and commit it there; the manifest
        committed (a compressed copy's inner manifest: what records name). Each chunk is charged to the
        budgets of both tiers (a read of one, a write of the other). A compressed source is read
        decoded, or its compressed frames pass through to a tier that compresses too (its raw frames
        encoded there, where that tier encodes them: :mod:`tierckpt.datapath.recode`); a tier that
        compresses encodes a plain source (:mod:`tierckpt.datapath.copysource`). ``alone``: a copy no
        other rank makes (see :meth:`Room.reserve`)."""
        dst, background = room.tier, room.background
        encodes = room.compresses
        with src.open_copy(key) as copy:  # manifest and blobs of one copy; blob sizes checked at open
            source = open_copy_source(
                src, key, copy, blobs, encodes=encodes, background=background, recodes=room.recodes if encodes else None
            )
        try:
            writer = room.reserve(
                key, source.blobs, alone=alone, codec=source.plan, held=source.held, decided=source.decided
            )
        except BaseException:
            source.reader.close()
            raise
        chunk = self.geometries[dst.name].chunk_bytes
        try:
            try:
                source.copy(src, dst, writer, key, chunk, self.workers[dst.name].pool)
            finally:
                source.reader.close()
            writer.commit(source.manifest)
        except BaseException:
            writer.abort()
            raise
        return source.inner

    # -- room -------------------------------------------------------------------------------------------
    def reserve(
        self,
        tier: Tier,
        key: CheckpointKey,
        blobs: Sequence[BlobEntry],
        *,
        background: bool = True,
        place_key: str | None = None,
        codec: Manifest | ManifestHead | None = None,
        held: Sequence[int] | None = None,
        decided: bool = False,
    ) -> TierWriter:
        """Reserve room on ``tier`` (a writer that honours the tier's declared write order, its writes
        charged to the tier's budget as ``background`` says), making room as :meth:`with_room` says; the
        writer's commit makes room too when the device is full as the manifest is written. On a
        ``node_files`` tier the copy's place comes first, from its node's exchange under ``place_key``
        (None: a node file of this rank's own; :mod:`tierckpt.ranks.nodeplace`). With ``codec`` (the
        copy's manifest, or its plan) and a tier that compresses, the writer takes raw blob bytes and
        stores them encoded (:mod:`tierckpt.datapath.codecwrite`); with ``held``, it takes a compressed
        copy's stored streams, blob ``i`` ending at ``held[i]``; ``decided``: whether ``codec`` is encoded
        was decided already (``auto`` is not asked again)."""
        if tier.node_files:
            place = self.ranks.place(tier, key, blobs, place_key)

            def made() -> TierWriter:
                return tier.reserve_at(key, blobs, place)
        else:

            def made() -> TierWriter:
                return tier.reserve(key, blobs)

        chunk = self.geometries[tier.name].chunk_bytes

        def reserve() -> TierWriter:
            writer = throttled_writer(tier, made(), background=background)
            return storing_writer(
                tier, writer, blobs, chunk_bytes=chunk, background=background, codec=codec, held=held, decided=decided
            )

        writer = self.with_room(tier, key.step, reserve)
        return _CommitsWithRoom(writer, lambda commit: self.with_room(tier, key.step, commit))

    def with_room(self, tier: Tier, step: int, attempt: Callable[[], T]) -> T:
        """``attempt()`` (a reservation, a commit or a commit record of ``step`` on ``tier``), again each
        time room was made. When the tier is full (its capacity, or its device:
        :class:`~tierckpt.errors.DeviceFullError`), do what its :class:`~tierckpt.policies.MakeRoom` plan
        says: evict its oldest copy that another tier holds (a lower one, for a full device; never a
        pinned or held one); or wait for the transfers that pin copies on it (``on_full: wait``,
        backpressure); or fail (``on_full: fail``, or nothing will free room)."""
        tried: set[int] = set()  # victims evicted once: one still there failed to go (logged), and is not tried again
        while True:
            try:
                return attempt()
            except TierFullError as full:
                self._make_room(tier, step, full, tried)

    def _make_room(self, tier: Tier, step: int, full: TierFullError, tried: set[int]) -> None:
        """One round of :meth:`with_room`: evict a victim not ``tried`` yet, or wait a while; raise when
        nothing frees room (every victim was tried, and is still there: its eviction failed). Copies
        evicted from the tier whose files are still being deleted are waited for first; on a tier whose
        copies share node files that is all (one rank's eviction would free no node file)."""
        if self.reclaimer.settle(tier.name):
            return
        if tier.node_files:  # a node file holds every rank's copy of its node: one rank's eviction frees nothing
            raise full
        self.apply_retention()
        committed = self.ranks.listing.committed_all()
        event = MakeRoom(tier.name, step, device=isinstance(full, DeviceFullError))
        room = place(event, self.policy, self.catalog.view(committed, self.held.copies()))
        victims = [v for v in room.victims if v not in tried]
        if victims:
            log.info("tier %r is full: evicting step %d (another tier holds it)", tier.name, victims[0])
            tried.add(victims[0])
            self.ranks.evict(tier, victims[0], alone=True)
            return
        if room.victims:
            log.warning(
                "tier %r is full and evicting steps %s freed no room (their eviction failed): step %d fails there",
                tier.name, sorted(room.victims), step,
            )  # fmt: skip
            raise full
        with self.catalog.changed:  # decided again under the lock: no unpin is missed
            room = place(event, self.policy, self.catalog.view(committed, self.held.copies()))
            if [v for v in room.victims if v not in tried]:  # a copy became evictable meanwhile
                return
            if not room.wait:
                explained = self.held.explain_full(tier.name, full)
                if explained is full:
                    raise full
                raise explained from full
            if tier.name not in self._full_logged:
                self._full_logged.add(tier.name)
                log.info(
                    "tier %r is full: step %d waits until steps %s have moved down",
                    tier.name, step, list(room.waiting_on),
                )  # fmt: skip
            self.catalog.changed.wait(1.0)

    def apply_retention(self, free: bool = True, shared: list[tuple[str, int]] | None = None) -> set[str]:
        """Evict what the retention plan says now, as this rank's part of it
        (:meth:`RankExecutor.agree <tierckpt.background.executor.RankExecutor.agree>`), and the orphans
        the listing found; return the names of the tiers evicted from. ``free=False``: the copies are
        only unlisted, and the caller frees their space with ``Tier.reclaim()``. In a job of several
        ranks, evictions from shared tiers are rank 0's decision, made with a commit every rank makes
        and sent with its outcome (``shared``, see :meth:`_shared_evictions`): no collective of its own;
        a pass without one (after a promotion, a failed commit, for a full tier) leaves shared tiers to
        the next commit."""
        with self.evict_lock:
            committed = self.ranks.listing.committed_all(everyone=True)
            plan = self.ranks.agree(place(Retain(), self.policy, self.catalog.view(committed)), shared)
            self.held.update(plan.held)
            self.ranks.sweep()
            for name, step in plan.evict:
                log.debug("retention: evicting step %d from tier %r", step, name)
                self.ranks.evict(self.tiers[name], step, free=free)
            gone = set(plan.evict)
            self.catalog.prune({s for n, steps in committed.items() for s in steps if (n, s) not in gone})
            return {name for name, _ in plan.evict}

    def _shared_evictions(self, tier: str, step: int) -> list[tuple[str, int]]:
        """Rank 0, in a commit of ``step`` on ``tier`` every rank makes (once every rank's copy is in and
        the step's record is written): what its retention plan evicts from shared tiers, the steps'
        records removed already (every rank then evicts its copy). The step counts as committed there
        already (a tier the catalog follows learns it only once the commit returns)."""
        if not self.ranks.shared:
            return []
        with self.evict_lock:
            committed = self.ranks.listing.committed_all()
            committed[tier] = sorted({*committed.get(tier, ()), step})
            plan = place(Retain(), self.policy, self.catalog.view(committed))
            return self.ranks.decide_shared(plan.evict)

    def close(self, timeout: float | None = None) -> None:
        for w in self.workers.values():
            w.close(timeout)
        self.reclaimer.close(timeout)
