"""The background mover's machinery: one worker thread per tier, and the blob copy between two tiers.

Every job that ends in a commit on tier T (the first copy of a save, a demotion to T, a promotion to
T) runs on T's worker, in submission order, so saves reach each tier in the order they were made. A
worker spends its time in the I/O engine's futures (the engine's thread waits in the kernel without
the GIL, URING.md §6) or in ``memmove`` (which releases the GIL), so a training thread beside it
keeps running.

Copies never re-serialize anything: the blobs are copied byte for byte and the destination commits
the source's manifest. Memory → file writes straight from the memory tier's blob buffers; file →
memory reads straight into them; file → file goes through a few staging buffers, in chunks sized for
the destination (its stripe-aligned ``chunk_bytes``), reads and writes overlapping.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from tierckpt.errors import CorruptCheckpointError, TierckptError, TierFullError
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import StagingPool, memmove
from tierckpt.orchestration.catalog import HeldCopies, Tracker
from tierckpt.policies.retention import RetentionPolicy, capacity_victims, plan_retention
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader, TierWriter

__all__ = ["Mover", "Worker", "copy_blobs"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_STOP = object()
_PAGE = 4096  # the memory alignment O_DIRECT asks for (512 on some disks, never more than a page)


class Worker:
    """A thread that runs one tier's jobs in FIFO order. Started on first use.

    Args:
        name: thread name suffix (the tier's name).
        staging: factory of this worker's staging pool (created on first use, one per worker so two
            workers never wait on each other's buffers).
    """

    def __init__(self, name: str, staging: Callable[[], StagingPool]) -> None:
        self.name = name
        self._make_pool = staging
        self._pool: StagingPool | None = None
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def pool(self) -> StagingPool:
        """This worker's staging buffers (only its own thread uses them)."""
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn``; the future holds its result or exception."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"worker {self.name!r} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"tierckpt-{self.name}", daemon=True)
                self._thread.start()
            self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the queued jobs; join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._q.put(_STOP)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._pool = None


def _check_count(got: int, want: int, src: Tier, key: CheckpointKey, blob: BlobEntry, off: int) -> None:
    if got != want:
        raise CorruptCheckpointError(
            f"blob is truncated: read {got} of {want} bytes at offset {off}",
            tier=src.name,
            step=key.step,
            blob=blob.name,
        )


def copy_blobs(
    src: Tier,
    reader: TierReader,
    dst: Tier,
    writer: TierWriter,
    key: CheckpointKey,
    blobs: Sequence[BlobEntry],
    chunk: int,
    pool: Callable[[], StagingPool],
) -> None:
    """Copy every blob from ``reader`` to ``writer``; returns when every write has completed.

    Args:
        src: the source tier (for error messages, and its device copy).
        dst: the destination tier (its device copy).
        chunk: bytes per operation (a multiple of both tiers' alignment).
        pool: staging buffers for file → file copies.

    Raises:
        CorruptCheckpointError: a source blob is shorter than the manifest says.
        OSError: from the engines, with path and errno.
    """
    pending: list[Future[int]] = []
    try:
        for b, blob in enumerate(blobs):
            sbuf, dbuf = reader.buffer(b), writer.buffer(b)
            if sbuf is not None and dbuf is not None and (sbuf.is_cpu and dbuf.is_cpu):  # memory → memory
                memmove(dbuf.data_ptr(), sbuf.data_ptr(), blob.size)
                continue
            if sbuf is not None and dbuf is not None:  # device memory ↔ memory: the device tier's own copy
                (src if not sbuf.is_cpu else dst).copy_buffer(dbuf, sbuf, blob.size)
                continue
            # device memory ↔ file, and memory that O_DIRECT may refuse (not page-aligned): through staging
            sbuf = sbuf if sbuf is None or _direct_ok(sbuf) else None
            dbuf = dbuf if dbuf is None or _direct_ok(dbuf) else None
            if sbuf is not None:  # memory → file: write from the source's own buffer
                if sbuf.numel() < blob.size:
                    _check_count(sbuf.numel(), blob.size, src, key, blob, 0)
                base = sbuf.data_ptr()
                pending += [writer.write(b, o, base + o, min(chunk, blob.size - o)) for o in range(0, blob.size, chunk)]
            elif dbuf is not None:  # file → memory: read into the destination's own buffer
                base = dbuf.data_ptr()
                reads = [
                    (o, n, reader.read(b, o, base + o, n))
                    for o in range(0, blob.size, chunk)
                    for n in [min(chunk, blob.size - o)]
                ]
                for o, n, f in reads:
                    _check_count(f.result(), n, src, key, blob, o)
            else:
                _copy_through_staging(src, reader, writer, key, b, blob, pool())
        for f in pending:
            f.result()
        pending = []
    finally:
        for f in pending:  # never leave a write running from memory the caller may free
            with contextlib.suppress(BaseException):  # cancelled
                f.exception()


def _direct_ok(buf: torch.Tensor) -> bool:
    """Whether a memory tier's buffer can be handed to the I/O engine as it is: CPU memory, page-aligned
    (what O_DIRECT asks for everywhere). A gpu tier on ``device="cpu"`` allocates plain tensors."""
    return buf.is_cpu and buf.data_ptr() % _PAGE == 0


def _copy_through_staging(
    src: Tier, reader: TierReader, writer: TierWriter, key: CheckpointKey, b: int, blob: BlobEntry, pool: StagingPool
) -> None:
    """File → file: read chunks into staging slots and write each as soon as its read is in."""
    chunk = pool.slot_bytes
    inflight: deque[list[Any]] = deque()  # [slot, offset, nbytes, read future, write future | None]

    def start_writes(block: bool) -> None:
        for e in inflight:
            slot, o, n, rf, wf = e
            if wf is not None:
                continue
            if not (block or rf.done()):
                return
            _check_count(rf.result(), n, src, key, blob, o)
            e[4] = writer.write(b, o, slot.data_ptr(), n)
            block = False

    def retire() -> None:
        start_writes(block=True)
        slot, _, _, _, wf = inflight.popleft()
        try:
            wf.result()
        finally:
            pool.release(slot)

    try:
        for o in range(0, blob.size, chunk):
            if len(inflight) >= pool.slots:
                retire()
            slot: torch.Tensor = pool.acquire()
            n = min(chunk, blob.size - o)
            inflight.append([slot, o, n, reader.read(b, o, slot.data_ptr(), n), None])
            start_writes(block=False)
        while inflight:
            retire()
    finally:
        while inflight:  # after an error: wait for what was issued before giving the buffers back
            slot, _, _, rf, wf = inflight.popleft()
            for f in (rf, wf):
                if f is not None:
                    with contextlib.suppress(BaseException):
                        f.exception()
            pool.release(slot)


class _Pins:
    """The source copies one transfer keeps from eviction; each released once."""

    def __init__(self, tracker: Tracker, step: int, tiers: Sequence[str]) -> None:
        self._tracker, self._step, self._held = tracker, step, list(tiers)
        self._lock = threading.Lock()
        for t in self._held:
            tracker.pin(step, t)

    def release(self, keep: str | None = None) -> None:
        """Release every pin except ``keep``'s."""
        with self._lock:
            drop = [t for t in self._held if t != keep]
            self._held = [t for t in self._held if t == keep]
        for t in drop:
            self._tracker.unpin(self._step, t)


class Mover:
    """Runs the hierarchy's copies on per-tier workers and applies retention after each change.

    Args:
        tiers: the chain, fastest first.
        retention: per tier name, its retention policy.
        tracker: the shared state records.
        rank: this process's rank (only its keys are touched).
        staging: per tier, a factory for that worker's staging pool.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        retention: Mapping[str, RetentionPolicy],
        tracker: Tracker,
        rank: int,
        staging: Callable[[Tier], StagingPool],
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.order = [t.name for t in tiers]
        self.retention = dict(retention)
        self.tracker = tracker
        self.rank = rank
        self.workers = {t.name: Worker(t.name, lambda t=t: staging(t)) for t in tiers}
        self._evict_lock = threading.Lock()
        self._full_logged: set[str] = set()
        self.held = HeldCopies(tracker)  # copies retention keeps beyond their window, and why

    # -- jobs -------------------------------------------------------------------------------------------
    def run_commit(
        self, tier: str, step: int, job: Callable[[], None], done: Future[None], announce: bool = True
    ) -> Future[None]:
        """Run ``job`` (reserve, write, commit on ``tier``) on the tier's worker; record the outcome in the
        tracker and in ``done``; apply retention afterwards. With ``announce`` the step shows as
        ``writing`` as soon as the job starts; otherwise the job says so itself (a transfer, once its
        source has committed)."""

        def run() -> None:
            if announce:
                self.tracker.set(step, tier, "writing")
            error: BaseException | None = None
            try:
                job()
            except BaseException as e:
                error = e
                self.tracker.set(step, tier, "failed", e)
                log.error("step %d: tier %r failed: %s", step, tier, e)
            else:
                self.tracker.set(step, tier, "committed")
                self.tracker.clear_promoted(tier, below=step)
            evicted: set[str] = set()
            try:
                # before the future resolves: after handle.wait(), retention has run (the evicted copies
                # are unlisted); their files are deleted after it, so a blocking save does not wait for that
                evicted = self.apply_retention(free=False)
            except Exception as e:  # retention problems are logged, never raised into a save
                log.warning("retention after step %d on tier %r failed: %s", step, tier, e)
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
            for name in evicted:
                try:
                    self.tiers[name].reclaim()
                except Exception as e:
                    log.warning("freeing the evicted copies on tier %r failed: %s", name, e)

        return self.workers[tier].submit(run)

    def transfer(
        self,
        key: CheckpointKey,
        dst: str,
        sources: Sequence[tuple[str, Future[None]]],
        done: Future[None],
        blobs: Sequence[BlobEntry] | None = None,
        promoted: bool = False,
        fallback: Callable[[], None] | None = None,
    ) -> None:
        """Queue a copy of ``key`` to ``dst`` from the first of ``sources`` (nearest first) whose future
        succeeds. The sources are pinned until the copy is over (the ones not needed are released as
        soon as the nearest one has committed). If every source failed, ``fallback`` (when given) writes
        the checkpoint to ``dst`` by other means: a save whose upper tiers all failed packs the caller's
        state straight into ``dst``, as long as it was not staged yet."""
        pins = _Pins(self.tracker, key.step, [s for s, _ in sources])
        if sources:
            first = sources[0][0]
            sources[0][1].add_done_callback(lambda f: pins.release(keep=first) if f.exception() is None else None)

        def job() -> None:
            try:
                try:
                    src = self._pick_source(key, dst, sources)
                except TierckptError:
                    if fallback is None:
                        raise
                    self.tracker.set(key.step, dst, "writing")
                    pins.release()
                    log.warning("step %d: every tier above %r failed; writing it there directly", key.step, dst)
                    fallback()
                    return
                pins.release(keep=src)
                self.tracker.set(key.step, dst, "writing")
                self._copy(key, self.tiers[src], self.tiers[dst], blobs)
                if promoted:
                    self.tracker.promoted(key.step, dst, True)
            finally:
                pins.release()

        self.tracker.plan(key.step, [dst])
        self.run_commit(dst, key.step, job, done, announce=False)

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

    def _copy(self, key: CheckpointKey, src: Tier, dst: Tier, blobs: Sequence[BlobEntry] | None) -> None:
        with src.open_copy(key) as copy:  # manifest and blobs of one copy; blob sizes checked at open
            manifest = copy.read_manifest()
            if blobs is None:
                from tierckpt.orchestration.restore import load_manifest

                blobs = load_manifest(src, key, copy=copy).blobs
            reader = copy.reader(blobs)
        align = max(src.capabilities.alignment_bytes, dst.capabilities.alignment_bytes)
        chunk = max(align, dst.chunk_bytes // align * align)
        try:
            writer = self.reserve(dst, key, blobs)
        except BaseException:
            reader.close()
            raise
        try:
            try:
                copy_blobs(src, reader, dst, writer, key, blobs, chunk, self.workers[dst.name].pool)
            finally:
                reader.close()
            writer.commit(manifest)
        except BaseException:
            writer.abort()
            raise

    # -- room -------------------------------------------------------------------------------------------
    def _committed(self, tier: Tier) -> list[int]:
        try:
            return [k.step for k in tier.list_committed(self.rank)]
        except OSError as e:
            log.warning("tier %r cannot list its checkpoints: %s", tier.name, e)
            return []

    def reserve(self, tier: Tier, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        """Reserve room on ``tier``. When it is full: evict its oldest copies that another tier holds
        (never a pinned or held one); if none can go yet but a transfer still pins copies on it, wait for it
        (``on_full: wait``, backpressure) or fail (``on_full: fail``)."""
        while True:
            try:
                return tier.reserve(key, blobs)
            except TierFullError as full:
                self.apply_retention()
                elsewhere = {s for t in self.tiers.values() if t is not tier for s in self._committed(t)}
                protected = self.tracker.pinned_on(tier.name) | {
                    s for s, t in self.tracker.protected() if t == tier.name
                }
                protected |= set(self.held.on(tier.name))  # the slowest copy of a step not yet safe
                victims = capacity_victims(self._committed(tier), elsewhere, protected, exclude=key.step)
                if victims:
                    log.info("tier %r is full: evicting step %d (another tier holds it)", tier.name, victims[0])
                    self._evict(tier, victims[0])
                    continue
                with self.tracker.changed:
                    waiting_on = self.tracker.pinned_on(tier.name) - {key.step}
                    if tier.on_full != "wait" or not waiting_on:
                        explained = self.held.explain_full(tier.name, full)
                        if explained is full:
                            raise
                        raise explained from full
                    if tier.name not in self._full_logged:
                        self._full_logged.add(tier.name)
                        log.info(
                            "tier %r is full: step %d waits until steps %s have moved down",
                            tier.name, key.step, sorted(waiting_on),
                        )  # fmt: skip
                    self.tracker.changed.wait(1.0)

    def _evict(self, tier: Tier, step: int, free: bool = True) -> None:
        self.tracker.set(step, tier.name, "evicting")
        try:
            tier.evict(CheckpointKey(step, self.rank), free=free)
        except OSError as e:
            log.warning("cannot evict step %d from tier %r: %s", step, tier.name, e)
            self.tracker.set(step, tier.name, "committed")
            return
        self.tracker.forget(step, tier.name)

    def apply_retention(self, free: bool = True) -> set[str]:
        """Evict what retention allows now (see :func:`tierckpt.policies.plan_evictions`); return the
        names of the tiers evicted from. ``free=False``: the copies are only unlisted, and the caller
        frees their space with ``Tier.reclaim()``."""
        with self._evict_lock:
            committed = {name: self._committed(t) for name, t in self.tiers.items()}
            plan = plan_retention(committed, self.retention, self.tracker.wanted(), self.tracker.protected())
            self.held.update(plan.held)
            for name, step in plan.evict:
                log.debug("retention: evicting step %d from tier %r", step, name)
                self._evict(self.tiers[name], step, free=free)
            gone = set(plan.evict)
            self.tracker.prune({s for n, steps in committed.items() for s in steps if (n, s) not in gone})
            return {name for name, _ in plan.evict}

    def close(self, timeout: float | None = None) -> None:
        for w in self.workers.values():
            w.close(timeout)
